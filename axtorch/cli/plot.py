"""``axtorch-plot``: draw metric curves of one or more runs from their ``metrics.jsonl`` files.

axtorch-plot runs=runs/quickstart
axtorch-plot runs=runs/quickstart,runs/gelu out=compare.png metrics=train/loss,eval/loss
axtorch-plot runs=runs/quickstart goodput=true
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from axtorch.cli.key_values import OldStyle, read_config
from axtorch.config.errors import ConfigError
from axtorch.train.curves import DEFAULT_METRICS, plot_goodput, plot_runs
from axtorch.train.goodput import breakdown_table, read_attempts
from axtorch.train.run_layout import GOODPUT_PLOT_FILE, LOSS_PLOT_FILE


@dataclass
class PlotConfig:
    #: Run directories holding metrics.jsonl (``runs=runs/a,runs/b``).
    runs: list[str] = field(default_factory=list)
    #: Image path (default: RUN_DIR/loss.png for one run, ./loss.png for several; goodput.png with goodput).
    out: Optional[str] = None
    #: Metric names, one subplot each.
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))
    #: Figure title.
    title: Optional[str] = None
    #: Logarithmic y axes.
    log_y: bool = False
    #: The wall-time breakdown of one run instead, as bars per attempt.
    goodput: bool = False

    def validate(self) -> None:
        if not self.runs:
            raise ConfigError("runs", self.runs, "one or more run directories, e.g. runs=runs/a,runs/b")
        if self.goodput and len(self.runs) != 1:
            raise ConfigError("runs", self.runs, "one run directory with goodput=true")


#: ``axtorch-plot RUN_DIR... --out FILE --metrics A B --title T --log-y --goodput``, as typed before key=value.
_OLD_STYLE = OldStyle(
    positional=("runs",),
    options={"--out": "out", "--metrics": "metrics", "--title": "title", "--log-y": "log_y", "--goodput": "goodput"},
)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``axtorch-plot``; returns 2 when a run dir has no metrics or no requested metric was logged."""
    try:
        args = read_config("axtorch-plot", argv, PlotConfig, __doc__ or "", _OLD_STYLE)
        if args is None:
            return 0
        runs = [Path(run) for run in args.runs]
        out = Path(args.out) if args.out is not None else None
        if out is None:
            name = GOODPUT_PLOT_FILE if args.goodput else LOSS_PLOT_FILE
            out = runs[0] / name if len(runs) == 1 else Path(name)
        if args.goodput:
            written = plot_goodput(runs[0], out)
            print(breakdown_table(read_attempts(runs[0])), "(seconds)")
        else:
            written = plot_runs(runs, out, metrics=args.metrics, title=args.title, log_y=args.log_y)
    except (FileNotFoundError, ValueError) as error:  # ConfigError is a ValueError
        print(f"axtorch-plot: error: {error}", file=sys.stderr)
        return 2
    print(written)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
