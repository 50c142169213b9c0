"""torchrun for tests: one place that builds the launcher command and runs it on this machine.

Tests start several CPU processes (gloo) with ``torch.distributed.run --standalone``; the launch
scripts under ``launch/`` take the ``torchrun`` executable instead (``TORCHRUN`` in their environment).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

#: The ``torchrun`` executable of the interpreter running the tests, for ``launch/*.sh`` (``TORCHRUN=``).
TORCHRUN_EXECUTABLE = Path(sys.executable).with_name("torchrun")


def torchrun(processes: int, python: Path | str = sys.executable) -> list[str]:
    """The launcher, ``processes`` processes on this one node; append a script or ``-m module`` and its arguments."""
    return [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]


def run_torchrun(
    processes: int,
    *program: str,
    python: Path | str = sys.executable,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 600,
    tail: int = 3000,
) -> subprocess.CompletedProcess[str]:
    """Run ``program`` under torchrun and require exit 0, showing the last ``tail`` characters of each stream
    if not (a rank's own error can sit well above torchrun's summary of the failed processes)."""
    result = subprocess.run(
        [*torchrun(processes, python), *program],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else dict(env),
        cwd=cwd,
    )
    assert result.returncode == 0, result.stdout[-tail:] + result.stderr[-tail:]
    return result
