"""``axtorch-golden``: write or check golden configs of axtorch's ``conf/`` or of your own config directory.

axtorch-golden action=check config_dirs=~/my_conf golden_dir=~/my_conf/golden   # in your CI
axtorch-golden action=write config_dirs=~/my_conf golden_dir=~/my_conf/golden   # after an intended change
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path

from axtorch.cli.key_values import OldStyle, read_config
from axtorch.compose.golden import compare_golden, snapshots, write_golden
from axtorch.config.errors import ConfigError


@dataclass
class GoldenConfig:
    #: check: compare the configs with the snapshots, exit 1 on a difference; write: (re)write the snapshots.
    action: str = "check"
    #: Your Hydra config directories (empty: axtorch's own conf/); ``--config-dir DIR`` as for axtorch-train.
    config_dirs: list[str] = field(default_factory=list)
    #: Where the snapshots live.
    golden_dir: str = "golden"

    def validate(self) -> None:
        if self.action not in ("check", "write"):
            raise ConfigError("action", self.action, "check or write")


#: ``axtorch-golden check --config-dir DIR --golden-dir DIR`` as it was typed before key=value.
_OLD_STYLE = OldStyle(
    positional=("action",),
    options={"--config-dir": "config_dirs", "--golden-dir": "golden_dir"},
    kept=("--config-dir",),
)


def main(argv: list[str] | None = None) -> int:
    try:
        args = read_config("axtorch-golden", argv, GoldenConfig, __doc__ or "", _OLD_STYLE)
        if args is None:
            return 0
        config_dirs = [Path(d).expanduser() for d in args.config_dirs]
        current = snapshots(config_dirs)
    except ConfigError as error:
        print(f"axtorch-golden: {error}", file=sys.stderr)
        return 2
    if not current:
        print(f"axtorch-golden: no experiment/ or model/ configs under {args.config_dirs}", file=sys.stderr)
        return 2
    golden_dir = Path(args.golden_dir).expanduser()
    if args.action == "write":
        write_golden(golden_dir, current)
        print(f"wrote {len(current)} golden configs to {golden_dir}")
        return 0
    diff = compare_golden(golden_dir, current)
    for name in diff.changed:
        old = (golden_dir / name).read_text().splitlines(keepends=True)
        sys.stdout.writelines(
            difflib.unified_diff(old, current[name].splitlines(keepends=True), f"golden/{name}", f"now/{name}")
        )
    for kind in ("missing", "stale"):
        for name in getattr(diff, kind):
            print(f"{kind}: {name}")
    if diff:
        print(
            f"axtorch-golden: {golden_dir} is out of date; run `axtorch-golden action=write` if the change is intended",
            file=sys.stderr,
        )
        return 1
    print(f"{len(current)} golden configs match {golden_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
