"""``sbatch launch/slurm.sbatch <overrides>`` on a real Slurm cluster of two nodes, each a host of its
own (tests/launch/slurm_cluster.py), as the script's header shows it, with the #SBATCH lines a CPU
cluster's user overrides: one-node and two-node jobs' losses equal to one device's; a preempted
job that saves, requeues without counting as a failure, and resumes exactly; a failed job that
requeues counting its failures; a node whose job step is killed, requeued and resumed exactly; a
node lost for good, whose job waits, says what to do, and resumes on the node left.
The one-node tests and the two-node preemption run on torch 2.9.0 too, whose torchrun passes on
a second SIGTERM, with Slurm's default KillWait=30."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from parallel.debug_runs import STEPS, debug_overrides, train_losses, train_on_one_device
from slurm_cluster import SlurmCluster, free_port
from torchrun_runs import TORCHRUN_EXECUTABLE
from train.process_runs import logged_steps

from axtorch.train.checkpoint import checkpoint_problems, read_model_tensors
from axtorch.train.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.journey]

SCRIPT = "launch/slurm.sbatch"
#: Long enough to interrupt twice: a debug step of two processes takes about 0.09 s on a busy
#: 2-core machine, and a signal's way through Slurm about one step (fresh-clone CI, 2026-12-05:
#: preemptions landed at steps 7 and 13, kills at 25), so a job is interrupted before its 30th
#: step and has 50 steps, about 4 s, to spare. Every run of the module uses it, so that their
#: schedules agree.
LONG_STEPS = 80
LONG = (f"trainer.max_steps={LONG_STEPS}", f"trainer.checkpoint_every={LONG_STEPS}", "trainer.plot=false")
FSDP2 = ("backend=native", "mesh.fsdp=2", "sharding=fsdp")


def _submit(slurm: SlurmCluster, out: Path, overrides: list[str], nodes: int = 1, **env: str) -> int:
    """Two CPU processes on one node, or one on each of ``nodes``: no GPUs, a node's 2 CPUs, a short time limit."""
    options = [f"--nodes={nodes}", "--gpus-per-node=0", "--cpus-per-task=2", "--time=15", f"--output={out}"]
    environment = {
        "NPROC": str(2 // nodes),
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


def _assert_resumed_exactly(run_dir: Path, straight_dir: Path, redone: bool = False) -> None:
    """Every step's loss and the final weights equal the uninterrupted job's; each step logged once,
    unless ``redone`` (a crash: the steps after the newest checkpoint ran twice; their last counts)."""
    losses, expected_losses = _losses_by_step(run_dir), _losses_by_step(straight_dir)
    assert (dict(losses) if redone else losses) == (dict(expected_losses) if redone else expected_losses)
    final = f"step_{LONG_STEPS:08d}"
    expected = read_model_tensors(straight_dir / "checkpoints" / final)
    got = read_model_tensors(run_dir / "checkpoints" / final)
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


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
    _assert_resumed_exactly(run_dir, root / "straight")


def test_a_job_whose_training_processes_alone_are_signalled_requeues_uncounted_on_their_203(
    slurm, straight, data_cache
):
    """``scancel --signal=TERM`` without ``--batch``: Slurm signals the job step's processes and not
    the batch script, whose trap never runs. The step's exit status, 203 from launch/preemptible.sh,
    is all it learns: that alone must requeue the job uncounted."""
    root, _ = straight
    run_dir, out = root / "step_signalled", root / "step_signalled.out"
    job = _submit(slurm, out, debug_overrides(run_dir, data_cache, *FSDP2, *LONG), MAX_REQUEUES="0")
    _wait_for_step(run_dir, 5)
    slurm.scancel("--signal=TERM", str(job))
    slurm.wait_until_requeued(job, 1)
    record = slurm.wait_until_finished(job)
    output = out.read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record, output[-3000:])
    assert output.count("preempted by SIGTERM at step") == 1, output[-3000:]
    assert "axtorch: preempted (exit 203)" in output and "axtorch-failures" not in record.get("Comment", "")
    _assert_resumed_exactly(run_dir, root / "straight")


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


@pytest.fixture(scope="module")
def two_nodes(slurm, straight, data_cache):
    """The uninterrupted run as a job of two nodes, one process on each: fsdp=2 across the hosts."""
    root, _ = straight
    overrides = debug_overrides(root / "two_nodes", data_cache, *FSDP2, *LONG)
    job = _submit(slurm, root / "two_nodes.out", overrides, nodes=2)
    return root, slurm.wait_until_finished(job)


def test_a_two_node_job_submitted_as_documented_matches_one_device(two_nodes):
    root, record = two_nodes
    output = (root / "two_nodes.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["NodeList"] == "node[0-1]", (record, output[-3000:])
    assert "axtorch: 2 nodes x 1 processes, rendezvous at node0:" in output, output[-3000:]
    single, distributed = train_losses(root / "single"), train_losses(root / "two_nodes")
    assert len(distributed) == LONG_STEPS
    torch.testing.assert_close(torch.tensor(distributed[:STEPS]), torch.tensor(single), rtol=1e-5, atol=1e-5)


def test_a_preempted_two_node_job_requeues_uncounted_and_resumes_exactly(slurm, two_nodes, data_cache):
    root, _ = two_nodes
    run_dir, out = root / "two_nodes_preempted", root / "two_nodes_preempted.out"
    job = _submit(slurm, out, debug_overrides(run_dir, data_cache, *FSDP2, *LONG), nodes=2, MAX_REQUEUES="0")
    _wait_for_step(run_dir, 5)
    slurm.scontrol("requeue", str(job))  # SIGTERM to every process of the job, on both nodes
    slurm.wait_until_requeued(job, 1)
    record = slurm.wait_until_finished(job)
    output = out.read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record, output[-3000:])
    assert output.count("preempted by SIGTERM at step") == 1 and "axtorch: preempted (exit 203)" in output
    assert "axtorch-failures" not in record.get("Comment", ""), record
    _assert_resumed_exactly(run_dir, root / "two_nodes")


def test_a_node_whose_job_step_is_killed_requeues_counted_and_resumes_exactly(slurm, two_nodes, data_cache):
    """Node 1's task (launch/preemptible.sh, torchrun, the worker) SIGKILLed whole, as a crash takes
    it: srun ends the step on both nodes, the script counts a failure and requeues, and the rerun
    resumes from the newest checkpoint."""
    root, _ = two_nodes
    run_dir, out = root / "two_nodes_killed", root / "two_nodes_killed.out"
    overrides = debug_overrides(run_dir, data_cache, *FSDP2, *LONG, "trainer.checkpoint_every=20")
    job = _submit(slurm, out, overrides, nodes=2, MAX_REQUEUES="1")
    _wait_for_step(run_dir, 25)
    for pid in slurm.hosts.pids(1):
        if Path(f"/proc/{pid}/comm").read_text().strip() not in ("slurmd", "slurmstepd"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    slurm.wait_until_requeued(job, 1)
    record = slurm.wait_until_finished(job)
    output = out.read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record, output[-3000:])
    assert record["Comment"] == "axtorch-failures=1" and "failure 1 of 1" in output, (record, output[-3000:])
    resumed = re.findall(r"resumed from \S+step_(\d+) at step", output)
    assert len(resumed) == 1 and int(resumed[0]) >= 20, output[-3000:]
    _assert_resumed_exactly(run_dir, root / "two_nodes", redone=True)


def test_a_node_that_never_comes_back_leaves_the_job_waiting_says_what_to_do_and_loses_no_checkpoint(
    slurm, two_nodes, data_cache
):
    """Node 1 gone whole (slurmd too), as a host that fails: Slurm marks it DOWN after SlurmdTimeout,
    cancels and requeues the job, which waits for two nodes; the job's output says which node and
    what to do. Doing it (scancel, then the job again on the one node left) resumes from the newest
    checkpoint exactly."""
    root, _ = two_nodes
    run_dir, out = root / "two_nodes_lost", root / "two_nodes_lost.out"
    overrides = debug_overrides(run_dir, data_cache, *FSDP2, *LONG, "trainer.checkpoint_every=20")
    job = _submit(slurm, out, overrides, nodes=2, MAX_REQUEUES="1")
    _wait_for_step(run_dir, 25)
    try:
        for pid in slurm.hosts.pids(1):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        slurm.wait_for(job, lambda job: "DOWN" in job["Reason"], "waiting for its nodes")
        record, output = slurm.job(job), out.read_text()
        assert record["JobState"] == "PENDING" and record["Restarts"] == "1", (record, output[-3000:])
        assert "axtorch-failures" not in record.get("Comment", ""), record
        said = f"axtorch: node node1 stopped responding; Slurm requeues job {job}, which waits for 2 nodes"
        assert said in output and f"scancel {job}, then sbatch --nodes=<fewer>" in output, output[-3000:]
        # Not reported as a preemption (a survivor's traceback may quote the trainer's source, which names it).
        assert "preempted by" not in output and "was preempted" not in output, output[-3000:]
        checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
        assert checkpoints and all(not checkpoint_problems(c) for c in checkpoints), checkpoints
        slurm.scancel(str(job))
        rerun_out = root / "two_nodes_lost_rerun.out"
        record = slurm.wait_until_finished(_submit(slurm, rerun_out, overrides, nodes=1))
        output = rerun_out.read_text()
        assert record["JobState"] == "COMPLETED", (record, output[-3000:])
        resumed = re.findall(r"resumed from \S+step_(\d+) at step", output)
        assert [int(step) for step in resumed] == [int(checkpoints[-1].name.removeprefix("step_"))], output[-3000:]
        _assert_resumed_exactly(run_dir, root / "two_nodes", redone=True)
    finally:
        slurm.bring_back(1)
