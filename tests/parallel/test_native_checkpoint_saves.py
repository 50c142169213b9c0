"""Checkpoint saves across two native (gloo) processes: a failure on one rank fails the save on
every rank without a hang, and asynchronous saves coordinate beside the training's collectives."""

from __future__ import annotations

import errno
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from axtorch.parallel.mesh import MeshConfig
from axtorch.parallel.native import NativeBackend
from axtorch.parallel.sharding import ShardingConfig
from axtorch.parallel.shutdown import exit_process
from axtorch.train import checkpoint as checkpoint_module
from axtorch.train.checkpoint import Checkpointer, checkpoint_problems, list_checkpoints, read_model_tensors
from axtorch.train.checkpoint_manifest import CheckpointError
from axtorch.train.optimizer import OptimConfig, build_optimizer

pytestmark = pytest.mark.journey

WORLD = 2


def _sharded_model_and_optimizer(backend: NativeBackend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))
    fully_shard(model, mesh=backend.mesh["fsdp"])
    optimizer = build_optimizer(model, OptimConfig())
    return model, optimizer


def _train_step(model, optimizer) -> None:
    model(torch.randn(3, 6)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _worker(rank: int, root: str, scenario: str, results: str) -> None:
    outcome = "ok"
    try:
        # A file rendezvous: no port to race for with whatever else runs on the machine.
        dist.init_process_group("gloo", init_method=f"file://{results}/rendezvous", rank=rank, world_size=WORLD)
        backend = NativeBackend(MeshConfig(fsdp=WORLD), ShardingConfig())
        model, optimizer = _sharded_model_and_optimizer(backend)
        _train_step(model, optimizer)
        async_save = scenario.startswith("async")
        checkpointer = Checkpointer(Path(root), keep=3, async_save=async_save, collective=backend)
        checkpointer.save(1, model, optimizer, {"step": 1})
        checkpointer.wait()
        if scenario.endswith("fails_on_rank_1") and rank == 1:
            real = checkpoint_module.save_file

            def full_disk(tensors, filename, metadata=None):
                raise OSError(errno.ENOSPC, "No space left on device", str(filename))

            checkpoint_module.save_file = full_disk
        _train_step(model, optimizer)
        try:
            checkpointer.save(2, model, optimizer, {"step": 2})
            if async_save:  # the training thread's collectives go on while the writer coordinates
                for _ in range(3):
                    _train_step(model, optimizer)
                    dist.all_reduce(torch.ones(1))
            checkpointer.wait()
        except CheckpointError as error:
            outcome = f"CheckpointError: {error}"
        finally:
            if scenario.endswith("fails_on_rank_1") and rank == 1:
                checkpoint_module.save_file = real
        expected = {name: t.full_tensor() for name, t in model.state_dict().items()} if outcome == "ok" else {}
        if not async_save and outcome == "ok":
            torch.save(expected, Path(results) / f"expected{rank}.pt")
        backend.close()
    except Exception:
        outcome = traceback.format_exc()
    (Path(results) / f"rank{rank}.txt").write_text(outcome)
    exit_process(0, skip_finalization=True)  # the outcome is recorded; gloo's threads would race teardown


def _run(tmp_path: Path, scenario: str) -> list[str]:
    root, results = tmp_path / "checkpoints", tmp_path / "results"
    results.mkdir(parents=True)
    context = mp.start_processes(
        _worker, args=(str(root), scenario, str(results)), nprocs=WORLD, join=False, start_method="spawn"
    )
    for _ in range(120):  # a hang fails the test instead of stalling the suite
        if context.join(timeout=1):
            break
    else:
        for process in context.processes:
            process.kill()
        pytest.fail(f"{scenario}: the processes hung")
    return [(results / f"rank{rank}.txt").read_text() for rank in range(WORLD)]


@pytest.mark.parametrize("saving", ["sync", "async"])
def test_a_save_failing_on_one_rank_fails_on_every_rank_and_keeps_the_earlier_checkpoint(tmp_path, saving):
    outcomes = _run(tmp_path, f"{saving}_fails_on_rank_1")
    for outcome in outcomes:
        assert outcome.startswith("CheckpointError: writing checkpoint step_00000002 failed"), outcome
        assert "rank 1: OSError: [Errno 28] No space left on device" in outcome
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # the partial directory is gone
    assert checkpoint_problems(root / "step_00000001") == []


def test_asynchronous_saves_across_ranks_equal_synchronous_ones(tmp_path):
    sync_outcomes = _run(tmp_path / "sync", "sync")
    async_outcomes = _run(tmp_path / "async", "async")
    assert sync_outcomes == async_outcomes == ["ok", "ok"], sync_outcomes + async_outcomes
    for saved in ("sync", "async"):
        steps = [p.name for p in list_checkpoints(tmp_path / saved / "checkpoints")]
        assert steps == ["step_00000001", "step_00000002"]
    synchronous = read_model_tensors(tmp_path / "sync" / "checkpoints" / "step_00000002")
    asynchronous = read_model_tensors(tmp_path / "async" / "checkpoints" / "step_00000002")
    expected = torch.load(tmp_path / "sync" / "results" / "expected0.pt")
    assert synchronous.keys() == asynchronous.keys() == expected.keys()
    for name in expected:
        assert torch.equal(synchronous[name], expected[name]) and torch.equal(asynchronous[name], expected[name])
