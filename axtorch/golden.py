"""``python -m axtorch.golden``: the same command as ``axtorch-golden`` (``axtorch/cli/golden.py``)."""

from axtorch.cli.golden import main

if __name__ == "__main__":
    raise SystemExit(main())
