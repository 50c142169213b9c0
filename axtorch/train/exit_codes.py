"""How an ``axtorch-train`` process ends: the exit codes a launcher acts on (docs/training.md, "Exit codes").

Two of them tell a scheduler what to do: 0, the run finished (do not restart it); ``PREEMPTED``,
the run stopped early on a signal after saving what it had (run the same command again, and do
not count it as a failure). The others are failures. ``PREEMPTED`` is 203 = 128 + 75 (sysexits'
``EX_TEMPFAIL``, "try again later"): at least 128, which Kubeflow's ``ExitCode`` restart policy
retries without counting against ``backoffLimit``, and above 128 + 64, so that no death by a
signal (128 + N) reads as a saved preemption.

torchrun restarts a worker group in place whenever a worker exits non-zero, and reports its own
status, not its workers'. So under a launcher that collects the run's status
(``launch/preemptible.sh`` sets ``AXTORCH_STATUS_FILE``) a preempted process writes the code
there and exits 0; the launcher then exits with it.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path


class ExitCode(enum.IntEnum):
    FINISHED = 0
    #: A crash, a checkpoint that failed to save (``on_save_error=stop``) or could not be resumed.
    FAILED = 1
    #: A config or command line that cannot run; nothing was trained.
    CONFIG_ERROR = 2
    #: ``trainer.nonfinite`` stopped the run after saving its last good state.
    NON_FINITE = 3
    #: A dry run (``dry_run=true``) whose step would not fit the named hardware's device memory.
    DOES_NOT_FIT = 4
    #: An XLA dry run (``dry_run=true backend=xla``) whose traced program splits a tensor otherwise
    #: than the sharding rules ask.
    MISSHARDED = 5
    #: The hang watchdog ended the process (``trainer.watchdog_action=exit``).
    HUNG = 124
    #: A signal stopped the run at a step boundary; its newest checkpoint holds everything trained.
    PREEMPTED = 203


#: Set by a launcher that reports the run's status itself (launch/preemptible.sh).
STATUS_FILE_ENV = "AXTORCH_STATUS_FILE"


def process_exit_code(code: ExitCode) -> int:
    """The status this process exits with for ``code``; see the module docstring for the status file."""
    status_file = os.environ.get(STATUS_FILE_ENV)
    if code is not ExitCode.PREEMPTED or not status_file:
        return int(code)
    path = Path(status_file)
    staged = path.with_name(f"{path.name}.{os.getpid()}")  # every process of the run writes the same
    staged.write_text(f"{int(code)}\n")
    os.replace(staged, path)
    return int(ExitCode.FINISHED)
