"""``python -m axtorch.tokenize``: the same command as ``axtorch-tokenize`` (``axtorch/cli/tokenize.py``)."""

from axtorch.cli.tokenize import main

if __name__ == "__main__":
    raise SystemExit(main())
