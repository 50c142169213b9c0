"""Killing a launched job whole: a launcher and every process below it, whatever session each leads."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # ended meanwhile
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def kill_process_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants at once, as a machine lost whole would go.

    Killing the launcher's process group is not enough: torchrun starts every worker in a session
    of its own, so its workers would outlive it and go on training.
    """
    groups = set()
    for member in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            groups.add(os.getpgid(member))
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
