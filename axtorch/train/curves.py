"""Metric curves of one or more runs, from their ``metrics.jsonl`` files (used by the trainer and ``axtorch-plot``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter

from axtorch.train.goodput import CATEGORIES, read_attempts, run_totals
from axtorch.train.metrics import read_metrics
from axtorch.train.run_layout import GOODPUT_FILE, METRICS_FILE

DEFAULT_METRICS = ("train/loss", "eval/loss")
_MAX_COLUMNS = 2
_MARKER_MAX_POINTS = 50


def plot_runs(
    run_dirs: Sequence[Path],
    out: Path,
    metrics: Sequence[str] = DEFAULT_METRICS,
    title: str | None = None,
    log_y: bool = False,
) -> Path:
    """Draws one subplot per metric with one line per run (labelled by the run dir's name) and saves it to ``out``.

    A metric that no run has logged yet (no eval so far) gets an empty subplot saying so; if none
    of ``metrics`` has any value, that is almost surely a misspelt name, so it raises instead.
    Uses a bare ``Figure`` (rendered by Agg), so it needs no display and leaves pyplot's global
    state alone in the trainer's process.
    """
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run dir")
    if not metrics:
        raise ValueError("plot_runs needs at least one metric name")
    run_dirs = [Path(run_dir) for run_dir in run_dirs]
    runs = {label: read_metrics(_metrics_file(run_dir)) for label, run_dir in zip(_labels(run_dirs), run_dirs)}
    curves = {metric: _curves(runs, metric) for metric in metrics}
    if not any(curves.values()):
        logged = sorted({name for records in runs.values() for record in records for name in record} - {"step"})
        raise ValueError(f"none of the metrics {list(metrics)} has a value in these runs; logged metrics: {logged}")

    columns = min(len(metrics), _MAX_COLUMNS)
    rows = math.ceil(len(metrics) / columns)
    figure = Figure(figsize=(6 * columns, 4 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    for ax in axes[1 : len(metrics)]:
        ax.sharex(axes[0])  # the same step range everywhere, so train and eval curves line up
    for ax, metric in zip(axes, metrics):
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
        if not curves[metric]:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        for label, (steps, values) in curves[metric].items():
            marker = "o" if len(steps) <= _MARKER_MAX_POINTS else None
            ax.plot(steps, values, label=label, marker=marker, markersize=3)
        if log_y:
            ax.set_yscale("log")
            # Plain numbers ("3") read better than "3x10^0" for losses spanning a decade or two.
            ax.yaxis.set_major_formatter(LogFormatter())
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.legend()
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)
    if title:
        figure.suptitle(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out


def _metrics_file(run_dir: Path) -> Path:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no {METRICS_FILE}; is it a run directory?")
    return path


def _labels(run_dirs: list[Path]) -> list[str]:
    """Legend labels: the run dirs' names, or their paths as given when two runs share a name."""
    names = [run_dir.resolve().name for run_dir in run_dirs]
    return names if len(set(names)) == len(names) else [str(run_dir) for run_dir in run_dirs]


def _curves(runs: dict[str, list[dict]], metric: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per run label, the steps and values at which ``metric`` was logged (``null`` spikes skipped)."""
    curves = {}
    for label, records in runs.items():
        points = [(record["step"], record[metric]) for record in records if record.get(metric) is not None]
        if points:
            steps, values = zip(*points)
            curves[label] = (list(steps), list(values))
    return curves


GOODPUT_COLOURS = {
    "productive": "tab:green",
    "startup": "tab:gray",
    "compile": "tab:purple",
    "redone": "tab:orange",
    "eval": "tab:blue",
    "checkpoint": "tab:cyan",
    "lost": "tab:red",
}


def plot_goodput(run_dir: Path, out: Path) -> Path:
    """One stacked bar of wall time per attempt of the run, and one for the whole run, by category."""
    attempts = read_attempts(run_dir)
    if not attempts:
        raise FileNotFoundError(f"{run_dir} has no {GOODPUT_FILE}; was it trained by this axtorch?")
    rows = [(f"attempt {a['attempt']}", a["seconds"]) for a in attempts]
    totals = run_totals(attempts)
    rows.append(("whole run", totals))
    figure = Figure(figsize=(10, 1.5 + 0.5 * len(rows)), layout="constrained")
    ax = figure.subplots()
    for row, (_, seconds) in enumerate(rows):
        left = 0.0
        for category in ("lost", *(c for c in CATEGORIES if c != "lost")):  # lost time comes before an attempt
            width = seconds[category]
            ax.barh(row, width, left=left, color=GOODPUT_COLOURS[category], label=category if row == 0 else None)
            left += width
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("wall time (s)")
    fraction = totals["productive"] / max(sum(totals.values()), 1e-9)
    ax.set_title(f"goodput {fraction:.1%} of {sum(totals.values()):.0f} s ({Path(run_dir).resolve().name})")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    return out
