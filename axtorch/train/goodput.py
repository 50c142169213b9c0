"""Goodput, as AXLearn reports it: where a run's wall time goes, across its restarts.

Each process attempt attributes its time to ``startup`` (from building the trainer to the first
step), ``compile`` (torch.compile's own seconds in any step, and the first step's excess over the
second beyond them: tracing, an XLA compile, warm-up),
``productive`` steps, ``redone`` steps (those a restart repeats because they came after the
checkpoint it resumed from), ``eval``, ``checkpoint`` (the training thread's share of saves) and
``lost`` (from the previous attempt's last record to this attempt's start: a crash, the restart).
The main process appends one cumulative line per update to ``<run_dir>/goodput.jsonl``, so even a
killed attempt leaves its last record, and mirrors the run's totals into the metrics as
``goodput/<category>_s`` and ``goodput/fraction``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

from axtorch.train.run_layout import GOODPUT_FILE

CATEGORIES = ("startup", "compile", "productive", "redone", "eval", "checkpoint", "lost")


def read_attempts(run_dir: Path) -> list[dict[str, Any]]:
    """The last (cumulative) record of each attempt, in order; a torn last line is ignored."""
    path = Path(run_dir) / GOODPUT_FILE
    latest: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            latest[record["attempt"]] = record
    return [latest[attempt] for attempt in sorted(latest)]


def run_totals(attempts: list[dict[str, Any]]) -> dict[str, float]:
    return {category: sum(a["seconds"][category] for a in attempts) for category in CATEGORIES}


def breakdown_table(attempts: list[dict[str, Any]]) -> str:
    """Seconds per category for each attempt and the whole run, as a Markdown table."""
    rows = [(f"attempt {a['attempt']}", a["seconds"]) for a in attempts]
    totals = run_totals(attempts)
    rows.append(("whole run", totals))
    lines = [
        "| | " + " | ".join(CATEGORIES) + " | wall | goodput |",
        "|---" * (len(CATEGORIES) + 3) + "|",
    ]
    for label, seconds in rows:
        wall = sum(seconds[c] for c in CATEGORIES)
        cells = " | ".join(f"{seconds[c]:.1f}" for c in CATEGORIES)
        lines.append(f"| {label} | {cells} | {wall:.1f} | {seconds['productive'] / max(wall, 1e-9):.1%} |")
    return "\n".join(lines)


class GoodputRecorder:
    """Attributes this attempt's wall time; ``write`` records it (main process only)."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.path = Path(run_dir) / GOODPUT_FILE
        self.enabled = enabled
        self.started = time.time()
        self.previous = read_attempts(run_dir)
        self.furthest_before = max((a["furthest_step"] for a in self.previous), default=0)
        self.furthest_step = self.furthest_before
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        if self.previous:
            self.seconds["lost"] = max(0.0, self.started - self.previous[-1]["wall"])
        self._first_step: Optional[float] = None
        self._steps_seen = 0

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds

    def start_training(self) -> None:
        self.seconds["startup"] = time.time() - self.started - self.seconds["eval"]

    def step_done(self, step: int, seconds: float, compile_seconds: float = 0.0) -> None:
        """A step of ``seconds`` ended at ``step``, ``compile_seconds`` of them in torch.compile.

        Compile time is what torch.compile measured, in any step, and the first step's excess over
        the second beyond it (tracing, an XLA compile, warm-up).
        """
        self._steps_seen += 1
        self.seconds["compile"] += compile_seconds
        seconds -= compile_seconds
        if self._steps_seen == 1:
            self._first_step = seconds
        elif self._steps_seen == 2 and self._first_step is not None:
            excess = max(0.0, self._first_step - seconds)
            self.seconds["compile"] += excess
            self._count(step - 1, self._first_step - excess)
        if self._steps_seen > 1:
            self._count(step, seconds)
        self.furthest_step = max(self.furthest_step, step)

    def _count(self, step: int, seconds: float) -> None:
        self.add("redone" if step <= self.furthest_before else "productive", seconds)

    def write(self) -> dict[str, float]:
        """Append this attempt's cumulative record; return the run's totals as metrics."""
        seconds = dict(self.seconds)
        if self._steps_seen == 1 and self._first_step is not None:  # no second step yet to compare with
            seconds["productive"] += self._first_step
        record = {
            "attempt": len(self.previous),
            "start": self.started,
            "wall": time.time(),
            "furthest_step": self.furthest_step,
            "seconds": seconds,
        }
        if self.enabled:
            with self.path.open("a") as file:
                file.write(json.dumps(record) + "\n")
        totals = run_totals([*self.previous, record])
        metrics = {f"goodput/{category}_s": value for category, value in totals.items()}
        metrics["goodput/fraction"] = totals["productive"] / max(sum(totals.values()), 1e-9)
        return metrics
