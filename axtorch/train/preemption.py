"""Preemption: SIGTERM (Kubernetes, Slurm, TPU maintenance) or SIGINT ends the run at a step boundary.

The signal only sets a flag; the loop finishes its current step, every process agrees on stopping
at the same step (the signal may reach them at different moments), a checkpoint is saved, and the
run exits with ``ExitCode.PREEMPTED`` so that the launcher restarts it and it resumes. A signal
during start-up stops the run before its first step, with nothing new to save.

Repeats are ignored, with a line on stderr: a launcher may pass on a signal that the scheduler
has already sent to every process (torch 2.9's torchrun forwards SIGTERM to workers that Slurm
signalled itself), and a second signal that acted at once would end a rank in the middle of the
save the first one asked for. The command line's watch goes on ignoring them after a stop was
asked, while the process exits: a repeat sent a moment later than the first would otherwise turn
the exit 203 into a death by SIGTERM. SIGKILL or SIGQUIT end a run at once.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any, Optional, Protocol

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Gather(Protocol):
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...


class PreemptionWatch:
    """While entered, turns the first SIGTERM or SIGINT into a request to stop at the next step
    boundary, and ignores the ones after it; each is acknowledged on stderr. Re-entrant: the
    command line enters it before start-up, and the trainer's loop enters the same watch again.

    ``until_exit``: the process ends with the run (the command line), so once a stop was asked the
    handlers stay after the watch ends, and repeats during the exit are ignored too."""

    def __init__(self, until_exit: bool = False) -> None:
        self.signal_name: Optional[str] = None
        self.until_exit = until_exit
        self._previous: dict[int, Any] = {}
        self._depth = 0

    def __enter__(self) -> PreemptionWatch:
        self._depth += 1
        if self._depth == 1 and threading.current_thread() is threading.main_thread():  # signals arrive there
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._request)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._depth -= 1
        if self._depth or (self.until_exit and self.signal_name):
            return
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _request(self, number: int, frame: Optional[FrameType]) -> None:
        name = signal.Signals(number).name
        stops = "the run stops at the next step boundary after saving"
        if self.signal_name is None:
            self.signal_name = name
            said = f"axtorch: {name}: {stops}"
        else:
            said = f"axtorch: {name} again, ignored: {stops} (asked by {self.signal_name})"
        # os.write, not print: the handler may interrupt a print to the same stream.
        os.write(2, f"{said}; SIGKILL or SIGQUIT end it at once\n".encode())

    def agreed(self, collective: _Gather) -> Optional[str]:
        """The signal that stops the run, if any process received one; the same answer on every process."""
        if collective.world_size == 1:
            return self.signal_name
        return next((name for name in collective.all_gather_object(self.signal_name) if name), None)
