from axtorch.cli.train import main

main()
