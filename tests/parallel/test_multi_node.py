"""launch/torchrun_multi_node.sh started as several nodes, as its header documents, each node a host of
its own on this machine (its own network namespace, address and hostname; the rendezvous at host
0's name; CPU gloo processes): FSDP and HSDP across two nodes train as one device
does, a checkpoint written by both nodes resumes on other node counts, and a lost node ends the
survivor through the documented rendezvous timeout, after which a rerun resumes exactly."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from debug_runs import STEPS, assert_weights_match_one_device, debug_overrides, train_losses
from network_hosts import NetworkHosts
from torchrun_nodes import Node, kill_node, start_nodes

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.checkpoint import MODEL, checkpoint_problems, read_index, read_model_tensors
from axtorch.train.metrics import read_metrics
from axtorch.train.trainer import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.journey]

FSDP4 = ("backend=native", "mesh.fsdp=4", "sharding=fsdp")
FSDP2 = ("backend=native", "mesh.fsdp=2", "sharding=fsdp")
HSDP = ("backend=native", "mesh.data=2", "mesh.fsdp=2", "sharding=fsdp")  # one replica per node
#: The RDZV_JOIN_TIMEOUT the lost-node run sets (the launcher's default is 600 s). It bounds the
#: first rendezvous too, so it leaves room for a loaded machine to start node 1.
JOIN_TIMEOUT_S = 30
RUN_TIMEOUT_S = 300
LAST_STEP = STEPS + 3


@dataclass
class LostNode:
    """The lost-node run: how its survivor ended, and its run directory after the rerun."""

    survivor_status: int
    survivor_seconds: float
    survivor_log: str
    killed_after_step: int
    #: The newest whole checkpoint's step when the rerun started, and what the rerun's nodes printed.
    newest_checkpoint: int
    rerun_log: str
    run_dir: Path


def _start(
    hosts: NetworkHosts, nnodes: int, nproc: int, run_dir: Path, cache: Path, *extra: str, **options
) -> list[Node]:
    """Start one job of the debug experiment over ``nnodes`` launchers; ``options`` go to start_nodes."""
    overrides = debug_overrides(run_dir, cache, *extra)
    logs = run_dir.with_name(f"{run_dir.name}.logs")
    return start_nodes(hosts, nnodes, nproc, overrides, logs / str(len(list(logs.glob("*")))), **options)


def _finish(*jobs: list[Node]) -> None:
    for node in (node for job in jobs for node in job):
        assert node.wait(RUN_TIMEOUT_S) == 0, node.tail()


def _resume_from_step(source: Path, target: Path) -> Path:
    """A run directory holding only ``source``'s checkpoint of step STEPS."""
    name = f"step_{STEPS:08d}"
    shutil.copytree(source / "checkpoints" / name, target / "checkpoints" / name)
    return target


def _losses_by_step(run_dir: Path) -> dict[int, float]:
    """Each step's training loss so far (the last attempt's where a step ran twice)."""
    path = run_dir / "metrics.jsonl"
    return {m["step"]: m["train/loss"] for m in read_metrics(path) if "train/loss" in m} if path.exists() else {}


def _whole_checkpoint(run_dir: Path, step: int) -> bool:
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    return path.is_dir() and not checkpoint_problems(path)


def _lose_a_node_then_rerun(run_dir: Path, cache: Path, start: Callable[..., list[Node]]) -> LostNode:
    """2 nodes under FSDP: node 1 killed whole once step 3 is logged and the checkpoint of step 2 is
    whole (saves are asynchronous: in a fresh clone's coverage run step 3 was logged while step 2's
    save was still writing), node 0's end timed; then both nodes started again, with the launcher's
    default timeout. A checkpoint of step 4 may be whole too, when that step completes as the kill
    lands."""
    extra = (*FSDP4, "trainer.checkpoint_every=2")
    # store_first (the default): node 0 hosts the rendezvous store, so losing node 1 is a join timeout.
    nodes = start(2, 2, run_dir, cache, *extra, env={"RDZV_JOIN_TIMEOUT": str(JOIN_TIMEOUT_S)})
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while max(_losses_by_step(run_dir), default=0) < 3 or not _whole_checkpoint(run_dir, 2):
        assert nodes[1].process.poll() is None and time.monotonic() < deadline, nodes[0].tail() + nodes[1].tail()
        time.sleep(0.01)
    kill_node(nodes[1])
    killed_at = time.monotonic()
    status = nodes[0].wait(RUN_TIMEOUT_S)
    survivor = (status, time.monotonic() - killed_at, nodes[0].tail(20000))
    # Read once node 0 has ended too: a step (and its checkpoint) may complete while the kill lands.
    killed_after_step = max(_losses_by_step(run_dir))
    whole = [path for path in (run_dir / "checkpoints").glob("step_*") if not checkpoint_problems(path)]
    newest_checkpoint = max((int(path.name.removeprefix("step_")) for path in whole), default=0)
    rerun = start(2, 2, run_dir, cache, *extra, store_first=False)
    _finish(rerun)
    log = "".join(node.tail(200_000) for node in rerun)
    return LostNode(*survivor, killed_after_step, newest_checkpoint, log, run_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """One device's uninterrupted run; two 2-node runs, their checkpoints resumed on other node counts;
    beside them, a 2-node run that loses a node, then is run again."""
    root = tmp_path_factory.mktemp("multi_node")
    cache = data_cache
    started: list[Node] = []

    def start(*args, **options) -> list[Node]:
        nodes = _start(hosts, *args, **options)
        started.extend(nodes)
        return nodes

    with NetworkHosts(4, root / "hosts") as hosts:
        try:
            with ThreadPoolExecutor(1) as side:
                lost_node = side.submit(_lose_a_node_then_rerun, root / "lost_node", cache, start)
                fsdp4 = start(2, 2, root / "fsdp4", cache, *FSDP4, store_first=False)
                hsdp = start(2, 2, root / "hsdp_static", cache, *HSDP, rdzv_backend="static", store_first=False)
                # Meanwhile (the launchers take seconds to start), and filling the data cache first.
                Trainer(load_experiment_config(debug_overrides(root / "single", cache))).fit()  # LAST_STEP steps
                _finish(fsdp4, hsdp)
                # Both nodes' checkpoint of step STEPS, resumed on one node and on four.
                on_one_node = _resume_from_step(root / "fsdp4", root / "fsdp4_on_1x2")
                on_four_nodes = _resume_from_step(root / "hsdp_static", root / "hsdp_on_4x1")
                _finish(
                    start(1, 2, on_one_node, cache, *FSDP2, store_first=False),
                    start(4, 1, on_four_nodes, cache, *FSDP4, store_first=False),
                )
                lost = lost_node.result()
        finally:
            for node in started:
                if node.process.poll() is None:  # a failed set-up leaves no job running
                    kill_node(node)
    return root, lost


@pytest.mark.parametrize("run", ["fsdp4", "hsdp_static"])
def test_two_nodes_train_as_one_device(runs, run):
    root, _ = runs
    single, nodes = train_losses(root / "single"), train_losses(root / run)
    assert len(single) == len(nodes) == LAST_STEP
    torch.testing.assert_close(torch.tensor(nodes), torch.tensor(single), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("run", "writers"), [("fsdp4", {0, 1, 2, 3}), ("hsdp_static", {0, 1})])
def test_each_rank_holds_its_shard_and_hsdp_one_replica_per_node(runs, run, writers):
    """Ranks 0-1 run on node 0 and 2-3 on node 1 (the static rendezvous numbers ranks by node). A block
    is written by the first replica that holds it: under FSDP over four, every rank writes its quarter
    of a matrix; under HSDP (data=2 x fsdp=2) node 0's two ranks write the halves of the whole first
    replica and node 1's ranks, holding the second, write none. Had the fsdp axis crossed the nodes,
    ranks 0 and 2 would write."""
    root, _ = runs
    index = read_index(root / run / "checkpoints" / f"step_{STEPS:08d}", MODEL)
    matrix = index["decoder.layers.0.attention.q_proj.weight"]
    rows = matrix["shape"][0]
    by_rank = {int(piece["file"].split("-")[1]): piece["offsets"][0] for piece in matrix["pieces"]}
    assert set(by_rank) == writers, by_rank
    assert sorted(by_rank.values()) == list(range(0, rows, rows // len(writers))), by_rank
    assert sorted(by_rank, key=by_rank.__getitem__) == sorted(writers)  # rank order is row order


@pytest.mark.parametrize("run", ["fsdp4", "hsdp_static"])
def test_both_nodes_write_one_checkpoint_equal_to_one_device(runs, run):
    root, _ = runs
    name = f"step_{STEPS:08d}"
    checkpoint = root / run / "checkpoints" / name
    assert len(list(checkpoint.glob("model-*-of-*.safetensors"))) == 4  # one per process, two per node
    assert_weights_match_one_device(checkpoint, root / "single" / "checkpoints" / name, run)


@pytest.mark.parametrize("run", ["fsdp4_on_1x2", "hsdp_on_4x1"])
def test_a_two_node_checkpoint_resumes_on_another_node_count(runs, run):
    root, _ = runs
    assert sorted(_losses_by_step(root / run)) == list(range(STEPS + 1, LAST_STEP + 1))
    reference = train_losses(root / "single")[STEPS:]
    torch.testing.assert_close(torch.tensor(train_losses(root / run)), torch.tensor(reference), rtol=1e-5, atol=1e-5)


def test_a_lost_node_ends_the_survivor_after_the_rendezvous_join_timeout(runs):
    """Node 1 killed whole: node 0's gloo collectives fail at once, torchrun restarts its workers and
    waits RDZV_JOIN_TIMEOUT for node 1 to rejoin, then gives up."""
    _, lost = runs
    assert lost.survivor_status != 0
    assert "RendezvousTimeoutError" in lost.survivor_log, lost.survivor_log[-3000:]
    # At least the join timeout, and not much more on a loaded machine (the default would be 600 s).
    assert JOIN_TIMEOUT_S <= lost.survivor_seconds < JOIN_TIMEOUT_S + 120


def test_both_nodes_rerun_after_a_lost_node_resume_exactly(runs):
    """The rerun resumes from the newest whole checkpoint (training again from step 0 would give the same
    losses: the run is deterministic), then ends bit for bit where the uninterrupted 2-node run did."""
    root, lost = runs
    assert lost.killed_after_step < LAST_STEP
    assert 2 <= lost.newest_checkpoint <= lost.killed_after_step
    resumed = re.findall(r"resumed from \S*step_(\d+) at step (\d+)", lost.rerun_log)
    assert resumed == [(f"{lost.newest_checkpoint:08d}", str(lost.newest_checkpoint))], lost.rerun_log[-3000:]
    assert train_losses(lost.run_dir) == train_losses(root / "fsdp4")  # bit for bit
    name = f"step_{LAST_STEP:08d}"
    expected = read_model_tensors(root / "fsdp4" / "checkpoints" / name)
    got = read_model_tensors(lost.run_dir / "checkpoints" / name)
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
