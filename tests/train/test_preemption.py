"""SIGTERM or SIGINT: finish the step, save, exit 0 naming the step; the resumed run equals an uninterrupted one."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from process_runs import logged_steps
from torchrun_runs import torchrun

from axtorch.train.checkpoint import checkpoint_problems, list_checkpoints, read_model_tensors

pytestmark = [pytest.mark.slow, pytest.mark.journey]


def _command(run_dir: Path, cache: Path, launcher: list[str], *extra: str) -> list[str]:
    return [
        *launcher,
        "-m",
        "axtorch.train",
        "experiment=debug",
        f"run_dir={run_dir}",
        f"data.cache_dir={cache}",
        "trainer.max_steps=60",
        "trainer.checkpoint_every=100",
        "trainer.eval_every=100",
        "trainer.log_every=1",
        "trainer.progress_bar=false",
        "trainer.plot=false",
        *extra,
    ]


def _interrupt(command: list[str], run_dir: Path, signal_number: int) -> subprocess.CompletedProcess:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while logged_steps(run_dir) < 5 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(signal_number)
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _preempted_step(output: str) -> int:
    line = next(line for line in output.splitlines() if line.startswith("preempted by"))
    return int(line.split(" at step ")[1].split(":")[0])


def _assert_resumed_run_equals_uninterrupted(command, straight_command, run_dir: Path, straight_dir: Path) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    subprocess.run(straight_command, check=True, capture_output=True, timeout=600)
    expected = read_model_tensors(straight_dir / "checkpoints" / "step_00000060")
    got = read_model_tensors(run_dir / "checkpoints" / "step_00000060")
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_at_a_step_boundary_and_exits_0(tmp_path, data_cache, signal_number):
    run_dir = tmp_path / "run"
    command = _command(run_dir, data_cache, [sys.executable])
    result = _interrupt(command, run_dir, signal_number)
    assert result.returncode == 0, result.stderr[-2000:]
    step = _preempted_step(result.stdout)
    assert f"preempted by {signal.Signals(signal_number).name} at step {step}" in result.stdout
    assert 5 <= step < 60
    checkpoint = list_checkpoints(run_dir / "checkpoints")[-1]
    assert checkpoint.name == f"step_{step:08d}" and checkpoint_problems(checkpoint) == []
    if signal_number == signal.SIGTERM:
        straight = _command(tmp_path / "straight", data_cache, [sys.executable])
        _assert_resumed_run_equals_uninterrupted(command, straight, run_dir, tmp_path / "straight")


def test_under_torchrun_every_rank_stops_at_the_same_step_and_the_resume_is_exact(tmp_path, data_cache):
    launcher = torchrun(2)
    parallel = ("backend=native", "mesh.fsdp=2", "sharding=fsdp")
    run_dir = tmp_path / "run"
    command = _command(run_dir, data_cache, launcher, *parallel)
    result = _interrupt(command, run_dir, signal.SIGTERM)
    # torchrun forwards the signal to its workers, then reports it itself (its own non-zero exit);
    # the workers agree on a step (a save whose ranks disagreed would hang), save and exit 0.
    step = _preempted_step(result.stdout)
    checkpoint = list_checkpoints(run_dir / "checkpoints")[-1]
    assert checkpoint.name == f"step_{step:08d}" and checkpoint_problems(checkpoint) == []
    straight = _command(tmp_path / "straight", data_cache, launcher, *parallel)
    _assert_resumed_run_equals_uninterrupted(command, straight, run_dir, tmp_path / "straight")
