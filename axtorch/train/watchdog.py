"""A hang watchdog: when no training step completes within a timeout, dump every thread's stack and act.

A stuck collective or data loader otherwise holds a whole cluster silently. The dump
(``<run_dir>/hang-rank<r>-<time>.txt``) shows where each thread of this process waits; with the
``exit`` action the process then ends with exit code 124, so the launcher restarts the job and it
resumes from its last checkpoint. The clock starts at the first completed step, after start-up and
compilation.
"""

from __future__ import annotations

import enum
import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Optional

from axtorch.train.exit_codes import ExitCode


class WatchdogAction(enum.Enum):
    #: Dump the stacks and end the process (exit 124), for the launcher to restart.
    exit = "exit"
    #: Dump the stacks, warn, and keep waiting.
    warn = "warn"


class Watchdog:
    """Context manager: call ``step_done()`` after every step; a background thread watches the gaps."""

    def __init__(self, timeout_s: Optional[float], action: WatchdogAction, run_dir: Path, rank: int):
        self.timeout_s = timeout_s
        self.action = action
        self.run_dir = run_dir
        self.rank = rank
        self._last_step: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def step_done(self) -> None:
        self._last_step = time.monotonic()

    def __enter__(self) -> Watchdog:
        if self.timeout_s is not None:
            self._thread = threading.Thread(target=self._watch, name="axtorch-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        assert self.timeout_s is not None
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            if self._last_step is None or time.monotonic() - self._last_step < self.timeout_s:
                continue
            path = self._dump_stacks()
            message = f"axtorch watchdog: no training step completed in {self.timeout_s:g} s; stacks in {path}"
            if self.action is WatchdogAction.exit:
                print(
                    f"{message}; exiting with {int(ExitCode.HUNG)} so that the launcher restarts the job",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(int(ExitCode.HUNG))  # the main thread is stuck: no clean way to unwind it
            print(message, file=sys.stderr, flush=True)
            self._last_step = time.monotonic()  # warn again only after another full timeout

    def _dump_stacks(self) -> Path:
        path = self.run_dir / f"hang-rank{self.rank}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with path.open("w") as file:
            faulthandler.dump_traceback(file, all_threads=True)
        return path
