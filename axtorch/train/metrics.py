"""Training metrics: an append-only JSONL log that survives crashes and resumes, mirrored to TensorBoard."""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from axtorch.train.run_layout import METRICS_FILE, TENSORBOARD_DIR

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class MetricsLogger:
    """Appends one JSON object per ``log`` call to ``run_dir/metrics.jsonl`` and mirrors it to TensorBoard.

    Each line reads ``{"step": 100, "train/loss": 2.31, ...}`` and is flushed to the OS as soon as
    it is written, so a crash of the training process loses no logged line (there is no fsync per
    step, so a power loss may).

    Non-finite values (a NaN or infinite loss spike) are written as JSON ``null``: the file stays
    strict JSON that any reader can parse, and a missing point marks the spike just as clearly on
    a plot. TensorBoard still receives the actual NaN or infinity.

    Reopening an existing run dir (a resume) appends to the same file; ``read_metrics`` drops the
    lines that the resumed run supersedes, and TensorBoard is told to hide its events from the
    first step logged after the reopen onwards (``purge_step``), so both views agree.
    """

    def __init__(self, run_dir: Path, enable_tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._resumed = self.path.exists() and self.path.stat().st_size > 0
        if self._resumed:
            _drop_torn_last_line(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        self._enable_tensorboard = enable_tensorboard
        # Created at the first log() because purge_step must be the first step of the resumed run.
        self._tensorboard: SummaryWriter | None = None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Writes ``metrics`` (scalars: floats, ints or one-element tensors) for ``step``."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if "step" in metrics:
            raise ValueError("metric name 'step' is reserved for the step number")
        values = {name: float(value) for name, value in metrics.items()}
        record = {"step": step, **{name: _finite_or_none(value) for name, value in values.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._enable_tensorboard:
            try:
                self._mirror_to_tensorboard(step, values)
            except Exception as error:
                self._enable_tensorboard = False
                warnings.warn(
                    f"TensorBoard logging failed and is off for this run ({type(error).__name__}: {error}); "
                    f"{self.path.name} still has every metric",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _mirror_to_tensorboard(self, step: int, values: Mapping[str, float]) -> None:
        if self._tensorboard is None:
            # Imported here so that readers of the file (axtorch-plot) do not pay for importing torch.
            from torch.utils.tensorboard import SummaryWriter

            _wait_for_a_later_event_file_second(self.run_dir / TENSORBOARD_DIR)
            self._tensorboard = SummaryWriter(
                str(self.run_dir / TENSORBOARD_DIR),
                purge_step=step if self._resumed else None,
            )
        for name, value in values.items():
            self._tensorboard.add_scalar(name, value, step)

    def close(self) -> None:
        """Flushes and closes both writers; calling it again does nothing."""
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict]:
    """Reads a ``metrics.jsonl`` file as written by ``MetricsLogger``, resolving resumes.

    A run that crashed and resumed from an earlier checkpoint logs some steps again. A restart is
    seen where the step goes backwards, or where the same step repeats a metric name already
    logged for it (several lines for one step with different names, such as train and eval
    metrics, are normal). At a restart, every earlier line with a step at or after the restart
    step is dropped, so each step keeps only what was written last.

    A last line without a newline is a write in progress or cut by a crash, and is ignored.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    lines.pop()  # "" when the file ends with a newline, else a torn line
    records = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{line_number}: not valid JSON ({error.msg}): {line[:80]!r}") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{line_number}: expected a JSON object with an int 'step': {line[:80]!r}")
        records.append(record)
    return _drop_superseded(records)


def _drop_superseded(records: list[dict]) -> list[dict]:
    kept: list[dict] = []
    names_at_last_step: set[str] = set()
    for record in records:
        step = record["step"]
        names = set(record) - {"step"}
        if kept:
            last_step = kept[-1]["step"]
            if step < last_step or (step == last_step and names & names_at_last_step):
                kept = [earlier for earlier in kept if earlier["step"] < step]
        if kept and kept[-1]["step"] == step:
            names_at_last_step |= names
        else:
            names_at_last_step = names
        kept.append(record)
    return kept


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _drop_torn_last_line(path: Path) -> None:
    """Cuts a last line left without its newline by a crash, which the next append would corrupt."""
    with path.open("rb+") as file:
        data = file.read()
        if not data.endswith(b"\n"):
            file.truncate(data.rfind(b"\n") + 1)


def _wait_for_a_later_event_file_second(directory: Path) -> None:
    """Make sure a new event file sorts after the existing ones.

    TensorBoard reads event files in name order, and names start with the creation second
    (followed by host, pid and a counter that do not sort numerically). A restart within the same
    second as an earlier file would otherwise be read first and its purge would not apply.
    """
    seconds = [
        int(m.group(1))
        for p in directory.glob("events.out.tfevents.*")
        if (m := re.match(r"events\.out\.tfevents\.(\d+)\.", p.name))
    ]
    if seconds and max(seconds) >= int(time.time()):
        time.sleep(max(seconds) + 1 - time.time())
