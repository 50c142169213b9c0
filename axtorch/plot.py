"""``python -m axtorch.plot``, the same command as ``axtorch-plot`` (``axtorch.cli.plot``)."""

from axtorch.cli.plot import main

if __name__ == "__main__":
    raise SystemExit(main())
