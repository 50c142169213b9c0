"""``sbatch launch/slurm.sbatch <overrides>`` on a real one-node Slurm cluster, as the script's header
shows it, with the #SBATCH lines a CPU cluster's user overrides: losses equal to one device's, and
a preempted job that saves, requeues without counting as a failure, and resumes exactly. Run on
torch 2.9.0 too, whose torchrun passes on a second SIGTERM, with Slurm's default KillWait=30."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from parallel.debug_runs import STEPS, debug_overrides, train_losses, train_on_one_device
from slurm_cluster import SlurmCluster, free_port
from torchrun_runs import TORCHRUN_EXECUTABLE
from train.process_runs import logged_steps

from axtorch.train.checkpoint import read_model_tensors
from axtorch.train.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.journey]

SCRIPT = "launch/slurm.sbatch"
#: Long enough to interrupt twice: a debug step takes well under 0.1 s, and a signal's way through
#: Slurm about 1 s. Every run of the module uses it, so that their schedules agree.
LONG_STEPS = 150
LONG = (f"trainer.max_steps={LONG_STEPS}", f"trainer.checkpoint_every={LONG_STEPS}", "trainer.plot=false")
FSDP2 = ("backend=native", "mesh.fsdp=2", "sharding=fsdp")


def _submit(slurm: SlurmCluster, out: Path, overrides: list[str], **env: str) -> int:
    """Two CPU processes on one node: no GPUs, the node's 2 CPUs, a short time limit."""
    options = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", "--time=15", f"--output={out}"]
    environment = {
        "NPROC": "2",
        "MASTER_PORT": str(free_port()),
        "TORCHRUN": str(TORCHRUN_EXECUTABLE),
    }
    return slurm.submit(options, SCRIPT, overrides, {**environment, **env})


def _losses_by_step(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["train/loss"]) for m in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in m]


def _wait_for_step(run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while logged_steps(run_dir) < step:
        assert time.monotonic() < deadline, f"no step {step} in {run_dir} after 300 s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def straight(slurm, tmp_path_factory, data_cache):
    """One device's first steps, and the same run as a Slurm job of 2 processes, uninterrupted."""
    root = tmp_path_factory.mktemp("slurm-runs")
    cache = data_cache
    train_on_one_device(root / "single", cache, *LONG)
    job = _submit(slurm, root / "straight.out", debug_overrides(root / "straight", cache, *FSDP2, *LONG))
    return root, slurm.wait_until_finished(job)


def test_a_job_submitted_as_documented_matches_one_device(straight):
    root, record = straight
    assert record["JobState"] == "COMPLETED", (record, (root / "straight.out").read_text()[-3000:])
    single, distributed = train_losses(root / "single"), train_losses(root / "straight")
    assert len(single) == STEPS and len(distributed) == LONG_STEPS
    torch.testing.assert_close(torch.tensor(distributed[:STEPS]), torch.tensor(single), rtol=1e-5, atol=1e-5)


def test_a_preempted_job_saves_requeues_uncounted_and_resumes_exactly(slurm, straight, data_cache):
    root, _ = straight
    run_dir, out = root / "preempted", root / "preempted.out"
    # MAX_REQUEUES=0: a preemption counted as a failure would end the job instead of requeueing it.
    job = _submit(slurm, out, debug_overrides(run_dir, data_cache, *FSDP2, *LONG), MAX_REQUEUES="0")
    # What --signal=B:TERM@120 sends before the time limit: SIGTERM to the batch script alone.
    _wait_for_step(run_dir, 5)
    slurm.scancel("--batch", "--signal=TERM", str(job))
    slurm.wait_until_requeued(job, 1)
    first = logged_steps(run_dir)
    # A preemption Slurm requeues itself (as PreemptMode=REQUEUE does): SIGTERM to every process.
    _wait_for_step(run_dir, first + 5)
    slurm.scontrol("requeue", str(job))
    slurm.wait_until_requeued(job, 2)
    record = slurm.wait_until_finished(job)

    output = out.read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "2", (record, output[-3000:])
    assert output.count("preempted by SIGTERM at step") == 2 and output.count("resumed from") == 2, output[-3000:]
    assert "not counted as a failure" in output and "axtorch-failures" not in record.get("Comment", "")
    # The job step ended with the "resume me" code both times (launch/preemptible.sh around torchrun).
    assert output.count("axtorch: preempted (exit 203)") == 2, output[-3000:]
    # Every step once, each loss equal to the uninterrupted job's: nothing lost or repeated.
    assert _losses_by_step(run_dir) == _losses_by_step(root / "straight")
    final = f"step_{LONG_STEPS:08d}"
    expected = read_model_tensors(root / "straight" / "checkpoints" / final)
    got = read_model_tensors(run_dir / "checkpoints" / final)
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


def test_a_failing_job_requeues_itself_max_requeues_times(slurm, tmp_path, data_cache):
    """The script sees only srun's exit status: a torchrun that fails at once (``false``) stands in
    for a failed training run, without two minutes of Python start-ups on a loaded machine."""
    out = tmp_path / "failing.out"
    overrides = debug_overrides(tmp_path / "run", data_cache, *FSDP2)
    job = _submit(slurm, out, overrides, MAX_REQUEUES="1", TORCHRUN="false")
    slurm.wait_until_requeued(job, 1)
    record = slurm.wait_until_finished(job)
    output = out.read_text()
    assert record["JobState"] == "FAILED" and record["Restarts"] == "1", (record, output[-3000:])
    assert record["Comment"] == "axtorch-failures=1"
    assert output.count("requeueing job") == 1 and "failure 1 of 1" in output, output[-3000:]
    assert output.count("axtorch: 1 nodes x 2 processes") == 2, output[-3000:]  # the requeued run ran
