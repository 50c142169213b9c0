"""Ending a process that ran torch.distributed collectives, without Python's finalization.

A gloo worker thread releases a finished collective's tensors after the caller's ``wait()`` has
returned. If the caller has meanwhile dropped its own references, the release is the last one
and needs the GIL; once the interpreter is finalizing, taking the GIL ends the thread inside a
destructor and the C++ runtime aborts the process ("terminate called without an active
exception", SIGABRT): a finished run, all its files written, reported to torchrun as a crash.
``destroy_process_group`` does not join those threads while Python objects (device meshes, FSDP
modules, pipeline stages) still hold the group (pytorch/pytorch#179291 tried to fix this in torch
and was abandoned). So a multi-process run, once everything it writes is closed, leaves with
``os._exit``: its status is the run's, and finalization never starts.

A preempted run leaves the same way: finalization gives the signal handlers back to their
defaults, so a launcher's repeated SIGTERM arriving then would turn the exit 203 ("resume me")
into a death by signal; without finalization the handlers that ignore repeats last to the end.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def exit_process(status: int, skip_finalization: bool) -> NoReturn:
    """Exit with ``status``; without the interpreter's finalization if ``skip_finalization``
    (a process that ran collectives, or a preempted run)."""
    if not skip_finalization:
        raise SystemExit(status)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
