"""``python -m axtorch.export``, the same command as ``axtorch-export`` (``axtorch.cli.export``)."""

from axtorch.cli.export import main

if __name__ == "__main__":
    raise SystemExit(main())
