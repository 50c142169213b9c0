"""The machine a process runs on, as results measured or built on it are keyed: its CPU's model
and features, its vendor, and the per-user cache that holds such results (``$XDG_CACHE_HOME/axtorch``,
``~/.cache/axtorch`` by default), so that a home directory shared by different machines keeps one
result for each."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    """/proc/cpuinfo's lines (Linux), or none."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def cpu_identity() -> str:
    """The CPU's model and feature flags (Linux), or the platform's name: what ``-march=native``
    builds for, and what a measured speed belongs to."""
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = [line for line in _cpuinfo_lines() if line.split(":")[0].strip() in wanted]
    return "\n".join(dict.fromkeys(lines)) if lines else platform.machine() + platform.processor()


def cpu_vendor() -> str:
    """The CPU's vendor as Linux reports it (``AuthenticAMD``, ``GenuineIntel``), or ""."""
    return next((line.partition(":")[2].strip() for line in _cpuinfo_lines() if line.startswith("vendor_id")), "")


def axtorch_cache() -> Path:
    """axtorch's per-user cache directory (not created here)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "axtorch"
