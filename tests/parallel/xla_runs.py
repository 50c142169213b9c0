"""XLA runs on CPU virtual devices, each in its own process(es) under the xla environment.

torch_xla needs torch 2.9.0, so the workers run with the interpreter of a separate environment:
``$AXTORCH_XLA_PYTHON`` or ``.venv-xla/bin/python`` (``make test`` creates it).
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from debug_runs import train_losses
from torchrun_runs import torchrun

from axtorch.train.checkpoint import checkpoint_problems, list_checkpoints
from axtorch.train.exit_codes import ExitCode

ROOT = Path(__file__).resolve().parents[2]
XLA_PYTHON = Path(os.environ.get("AXTORCH_XLA_PYTHON", ROOT / ".venv-xla" / "bin" / "python"))
WORKER = Path(__file__).with_name("xla_worker.py")
#: The test workers' XLA programs are compiled without LLVM's optimizations: the XLA passes that
#: shard and fuse the program run as for a user, only the machine code is less tuned. A tiny
#: model's run is mostly compiling: a 3-step debug run on fsdp=2 x model=2 took 16.6 CPU-s, 12.0
#: with this, with the same losses. The documented XLA commands run as written, without it.
QUICK_COMPILE = "--xla_backend_optimization_level=0"

needs_xla = pytest.mark.skipif(
    not XLA_PYTHON.exists(), reason=f"no torch_xla environment at {XLA_PYTHON} (make test creates .venv-xla)"
)


def xla_env(devices: int, hosts: int = 1) -> dict[str, str]:
    """``devices`` CPU devices per process; ``hosts`` > 1: torchrun's processes act as that many hosts."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {QUICK_COMPILE}".strip()
    if hosts > 1:
        env["AXTORCH_XLA_SIMULATED_HOSTS"] = "1"
    return env


def run_worker(devices: int, out: Path, until: int, overrides: list[str], hosts: int = 1) -> list[dict]:
    """Train with ``xla_worker.py`` to step ``until``; every host's report, in host order."""
    launcher = [str(XLA_PYTHON)] if hosts == 1 else torchrun(hosts, XLA_PYTHON)
    command = [*launcher, str(WORKER), str(out), str(until), "backend=xla", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=xla_env(devices, hosts), cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if hosts == 1:
        return [json.loads(out.read_text())]
    return [json.loads(out.with_name(f"{out.stem}.host{host}.json").read_text()) for host in range(hosts)]


def wait_for_steps(process: subprocess.Popen, run_dir: Path, steps: int = 3) -> None:
    """Until ``process`` has logged ``steps`` losses (compiled, and past a few steps) or ended."""
    deadline = time.monotonic() + 600
    while process.poll() is None and time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(train_losses(run_dir)) >= steps:
            break
        time.sleep(0.2)


def preempted_checkpoint(process: subprocess.Popen, run_dir: Path) -> Path:
    """The checkpoint a SIGTERMed run saved: it exits 203 ("resume me"), says at which step, and that
    checkpoint is sound."""
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == ExitCode.PREEMPTED, stdout[-2000:] + stderr[-3000:]
    said = next(line for line in stdout.splitlines() if line.startswith("preempted by SIGTERM at step "))
    step = int(said.removeprefix("preempted by SIGTERM at step ").split(":")[0])
    assert 3 <= step < 500
    checkpoint = list_checkpoints(run_dir / "checkpoints")[-1]
    assert checkpoint.name == f"step_{step:08d}" and checkpoint_problems(checkpoint) == []
    return checkpoint
