from axtorch.cli.plot import main

if __name__ == "__main__":
    raise SystemExit(main())
