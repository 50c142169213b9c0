"""SIGKILL at random moments (mid-step, mid-checkpoint, mid-asynchronous save), several times a run,
on one device and under torchrun: the run that finally completes has exactly the parameters of one
that was never interrupted."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from process_runs import logged_steps
from process_tree import kill_process_tree
from quiet_runs import quiet_debug_run
from torchrun_runs import TORCHRUN_EXECUTABLE, torchrun

from axtorch.train.checkpoint import read_model_tensors

pytestmark = [pytest.mark.slow, pytest.mark.journey]
STEPS = 30


def _overrides(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return quiet_debug_run(
        run_dir,
        cache,
        f"trainer.max_steps={STEPS}",
        "trainer.checkpoint_every=2",
        "trainer.keep_checkpoints=2",
        "trainer.eval_every=100",
        "trainer.log_every=1",
        *extra,
    )


def _assert_equal_parameters(run_dir: Path, straight_dir: Path) -> None:
    expected = read_model_tensors(straight_dir / "checkpoints" / f"step_{STEPS:08d}")
    got = read_model_tensors(run_dir / "checkpoints" / f"step_{STEPS:08d}")
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


LAUNCHES = {
    # One device: the attempts alternate between synchronous and asynchronous saves, so kills land
    # both in a save on the training thread and in a background write.
    "one_device": ([sys.executable], ()),
    "torchrun_async": (
        torchrun(2),
        ("backend=native", "mesh.fsdp=2", "sharding=fsdp", "trainer.async_checkpoint=true"),
    ),
}


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_repeated_sigkills_then_a_resume_equal_an_uninterrupted_run(tmp_path, data_cache, launch):
    launcher, extra = LAUNCHES[launch]
    cache, run_dir = data_cache, tmp_path / "run"
    command = [*launcher, "-m", "axtorch.train", *_overrides(run_dir, cache, *extra)]
    alternate = launch == "one_device"
    subprocess.run(
        [*launcher, "-m", "axtorch.train", *_overrides(tmp_path / "straight", cache, *extra)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    chance = random.Random(f"kills-{launch}")
    kills = 0
    while kills < 4:
        # The kill takes the launcher and every process below it at once, as a lost node would (torchrun's
        # workers lead sessions of their own: a process-group kill would leave them training).
        attempt = [*command, f"trainer.async_checkpoint={str(kills % 2 == 1).lower()}"] if alternate else command
        process = subprocess.Popen(attempt, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        reached = logged_steps(run_dir) + 2 + chance.randrange(4)  # a few steps into this attempt
        deadline = time.monotonic() + 300
        while logged_steps(run_dir) < reached and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(chance.uniform(0, 0.3))  # anywhere in a step, a save or an asynchronous write
        if process.poll() is not None:
            break  # finished before this kill
        kill_process_tree(process.pid)
        process.wait()
        kills += 1
    assert kills >= 2
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    _assert_equal_parameters(run_dir, tmp_path / "straight")


def test_the_torchrun_launcher_restarts_a_killed_worker_and_the_run_ends_exact(tmp_path, data_cache):
    """One worker dies (SIGKILL) under launch/torchrun_single_node.sh: torchrun restarts the group in
    place, the restarted workers resume from the newest checkpoint, and the run exits 0 with the
    parameters of an uninterrupted run."""
    launcher = Path(__file__).resolve().parents[2] / "launch" / "torchrun_single_node.sh"
    env = {**os.environ, "NPROC": "2", "TORCHRUN": str(TORCHRUN_EXECUTABLE)}
    parallel = LAUNCHES["torchrun_async"][1]
    cache = data_cache
    straight = subprocess.run(
        [str(launcher), *_overrides(tmp_path / "straight", cache, *parallel)], capture_output=True, env=env, timeout=600
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [str(launcher), *_overrides(run_dir, cache, *parallel)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while logged_steps(run_dir) < 7 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # torchrun starts its workers as `python -u -m axtorch.train ...`; the newest is rank 1.
    workers = subprocess.run(
        ["pgrep", "-f", f" -u -m axtorch[.]train .*run_dir={run_dir} "], capture_output=True, text=True
    )
    victim = max(int(pid) for pid in workers.stdout.split())
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout, "the restarted workers did not resume from a checkpoint"
    _assert_equal_parameters(run_dir, tmp_path / "straight")
