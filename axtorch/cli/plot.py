"""``axtorch-plot``: draw metric curves of one or more runs from their ``metrics.jsonl`` files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from axtorch.train.goodput import breakdown_table, read_attempts
from axtorch.train.plot import DEFAULT_METRICS, plot_goodput, plot_runs
from axtorch.train.run_layout import GOODPUT_PLOT_FILE, LOSS_PLOT_FILE


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``axtorch-plot``; returns 2 when a run dir has no metrics or no requested metric was logged."""
    parser = argparse.ArgumentParser(prog="axtorch-plot", description="Plot metric curves of training runs.")
    parser.add_argument(
        "run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories holding metrics.jsonl"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=f"image path (default: RUN_DIR/{LOSS_PLOT_FILE} for one run, ./{LOSS_PLOT_FILE} for several)",
    )
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS), help="metric names, one subplot each")
    parser.add_argument("--title", help="figure title")
    parser.add_argument("--log-y", action="store_true", help="logarithmic y axes")
    parser.add_argument(
        "--goodput",
        action="store_true",
        help=f"the wall-time breakdown of one run instead (default: {GOODPUT_PLOT_FILE})",
    )
    args = parser.parse_args(argv)

    out = args.out
    if args.goodput and len(args.run_dirs) != 1:
        parser.error("--goodput draws one run directory")
    if out is None:
        name = GOODPUT_PLOT_FILE if args.goodput else LOSS_PLOT_FILE
        out = args.run_dirs[0] / name if len(args.run_dirs) == 1 else Path(name)
    try:
        if args.goodput:
            written = plot_goodput(args.run_dirs[0], out)
            print(breakdown_table(read_attempts(args.run_dirs[0])), "(seconds)")
        else:
            written = plot_runs(args.run_dirs, out, metrics=args.metrics, title=args.title, log_y=args.log_y)
    except (FileNotFoundError, ValueError) as error:
        print(f"axtorch-plot: error: {error}", file=sys.stderr)
        return 2
    print(written)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
