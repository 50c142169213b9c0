"""Preemption: SIGTERM (Kubernetes, Slurm, TPU maintenance) or SIGINT ends the run at a step boundary.

The signal only sets a flag; the loop finishes its current step, every process agrees on stopping
at the same step (the signal may reach them at different moments), a checkpoint is saved, and the
run exits 0 so that the launcher's restart resumes it. A second signal acts at once, as usual.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, Optional, Protocol

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Gather(Protocol):
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...


class PreemptionWatch:
    """While entered, turns the first SIGTERM or SIGINT into a request to stop at the next step boundary."""

    def __init__(self) -> None:
        self.signal_name: Optional[str] = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals only there
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._request)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _request(self, number: int, frame: Optional[FrameType]) -> None:
        self.signal_name = signal.Signals(number).name
        previous: Callable[..., Any] | int | None = self._previous.get(number)
        signal.signal(number, previous if previous is not None else signal.SIG_DFL)  # a second one acts at once

    def agreed(self, collective: _Gather) -> Optional[str]:
        """The signal that stops the run, if any process received one; the same answer on every process."""
        if collective.world_size == 1:
            return self.signal_name
        return next((name for name in collective.all_gather_object(self.signal_name) if name), None)
