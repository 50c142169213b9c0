"""``axtorch-golden``: write or check golden configs of axtorch's ``conf/`` or of your own config directory.

axtorch-golden check --config-dir ~/my_conf --golden-dir ~/my_conf/golden   # in your CI
axtorch-golden write --config-dir ~/my_conf --golden-dir ~/my_conf/golden   # after an intended change
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from axtorch.compose.golden import compare_golden, snapshots, write_golden
from axtorch.config.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="axtorch-golden", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("write", "check"))
    parser.add_argument(
        "--config-dir",
        action="append",
        default=[],
        type=Path,
        help="your Hydra config directory (repeatable); default: axtorch's own conf/",
    )
    parser.add_argument(
        "--golden-dir", type=Path, default=Path("golden"), help="where the snapshots live (default: ./golden)"
    )
    args = parser.parse_args(argv)
    try:
        current = snapshots(args.config_dir)
    except ConfigError as error:
        print(f"axtorch-golden: {error}", file=sys.stderr)
        return 2
    if not current:
        print(
            f"axtorch-golden: no experiment/ or model/ configs under {[str(d) for d in args.config_dir]}",
            file=sys.stderr,
        )
        return 2
    if args.action == "write":
        write_golden(args.golden_dir, current)
        print(f"wrote {len(current)} golden configs to {args.golden_dir}")
        return 0
    diff = compare_golden(args.golden_dir, current)
    for name in diff.changed:
        old = (args.golden_dir / name).read_text().splitlines(keepends=True)
        sys.stdout.writelines(
            difflib.unified_diff(old, current[name].splitlines(keepends=True), f"golden/{name}", f"now/{name}")
        )
    for kind in ("missing", "stale"):
        for name in getattr(diff, kind):
            print(f"{kind}: {name}")
    if diff:
        print(
            f"axtorch-golden: {args.golden_dir} is out of date; run `axtorch-golden write` if the change is intended",
            file=sys.stderr,
        )
        return 1
    print(f"{len(current)} golden configs match {args.golden_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
