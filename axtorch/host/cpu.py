"""The CPU a process runs on, as what is measured or built on it is keyed (the decode kernels'
build, the measured matmul peak): its model and features, and its vendor."""

from __future__ import annotations

import functools
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
