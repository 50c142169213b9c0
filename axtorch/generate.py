"""``python -m axtorch.generate``, the same command as ``axtorch-generate`` (``axtorch.cli.generate``)."""

from axtorch.cli.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
