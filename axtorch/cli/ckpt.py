"""``axtorch-ckpt``: inspect a run's checkpoints offline.

axtorch-ckpt action=list path=RUN_DIR              steps, sizes, validity and config digest of each checkpoint
axtorch-ckpt action=verify path=RUN_DIR|CKPT_DIR   check every file against its manifest; exit 1 if any fails
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from axtorch.cli.key_values import OldStyle, read_config
from axtorch.config.errors import ConfigError
from axtorch.train.checkpoint import TRAINER_STATE_FILE, checkpoint_problems, list_checkpoints
from axtorch.train.checkpoint_manifest import MANIFEST_FILE
from axtorch.train.run_layout import CHECKPOINTS_DIR


@dataclass
class CkptConfig:
    #: list: one line per checkpoint; verify: check every file against its manifest, exit 1 if any fails.
    action: str = "list"
    #: A run directory, or (verify) one checkpoint directory.
    path: Optional[str] = None

    def validate(self) -> None:
        if self.action not in ("list", "verify"):
            raise ConfigError("action", self.action, "list or verify")
        if not self.path:
            raise ConfigError("path", self.path, "a run directory or a checkpoints/step_* directory")


#: ``axtorch-ckpt list RUN_DIR`` as it was typed before key=value.
_OLD_STYLE = OldStyle(positional=("action", "path"))


def _checkpoints(path: Path) -> list[Path]:
    """A checkpoint directory itself, or every checkpoint of a run directory."""
    if (path / MANIFEST_FILE).is_file() or path.name.startswith("step_"):
        return [path]
    return list_checkpoints(path / CHECKPOINTS_DIR)


def _size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 2**20


def _config_digest(path: Path) -> str:
    try:
        return str(json.loads((path / TRAINER_STATE_FILE).read_text())["config_digest"])
    except (OSError, ValueError, KeyError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    try:
        args = read_config("axtorch-ckpt", argv, CkptConfig, __doc__ or "", _OLD_STYLE)
    except ConfigError as error:
        print(f"axtorch-ckpt: {error}", file=sys.stderr)
        return 2
    if args is None:
        return 0
    checkpoints = _checkpoints(Path(str(args.path)))
    if not checkpoints:
        print(f"axtorch-ckpt: no checkpoints under {args.path}", file=sys.stderr)
        return 2
    failed = 0
    if args.action == "list":
        print(f"{'step':>10}  {'MiB':>9}  {'config digest':16}  status")
    for path in checkpoints:
        problems = checkpoint_problems(path)
        failed += bool(problems)
        status = "ok" if not problems else "DAMAGED: " + "; ".join(problems)
        if args.action == "list":
            step = path.name.removeprefix("step_").lstrip("0") or "0"
            print(f"{step:>10}  {_size_mib(path):>9.1f}  {_config_digest(path):16}  {status}")
        else:
            print(f"{path}: {status}")
    if args.action == "verify":
        print(f"{len(checkpoints) - failed} of {len(checkpoints)} checkpoints verified")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
