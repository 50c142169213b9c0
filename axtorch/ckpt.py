"""``python -m axtorch.ckpt``: the same command as ``axtorch-ckpt`` (``axtorch/cli/ckpt.py``)."""

from axtorch.cli.ckpt import main

if __name__ == "__main__":
    raise SystemExit(main())
