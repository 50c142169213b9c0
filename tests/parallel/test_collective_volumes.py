"""The planner's communication model against the bytes a real run sends (torchrun, gloo on CPU, 2 processes).

Each test runs one mesh of the debug model once: ``volume_worker.py`` prices every collective of
one training step as its ring algorithm sends it, and the planner predicts the same step.
"""

import json
from pathlib import Path

import pytest
from debug_runs import debug_overrides
from forked_ranks import run_ranks
from test_native_moe import MOE

from axtorch.parallel.pipeline_config import layer_ranges
from axtorch.plan import Planner, cluster_for, load_plan_inputs

pytestmark = pytest.mark.journey

WORKER = Path(__file__).with_name("volume_worker.py")
PROCESSES = 2
#: ``{kind: {"calls", "contributed", "sent"}}`` for one process, as the worker writes it.
Volumes = dict[str, dict[str, float]]


def _measured_and_predicted(
    tmp_path: Path, cache: Path, sharding: str, *overrides: str
) -> tuple[list[Volumes], dict[str, float]]:
    """Every process's measured volumes, and the planner's bytes per device for the same step."""
    overrides = (*overrides, f"sharding={sharding}")
    run_overrides = debug_overrides(tmp_path / "run", cache, "backend=native", *overrides)
    out = tmp_path / "volumes.json"
    run_ranks(PROCESSES, str(WORKER), str(out), *run_overrides, tail=12000)
    config, mesh = load_plan_inputs(["experiment=debug", *overrides])
    seq_len, batch = config.data.seq_len, config.trainer.batch_size
    planner = Planner(config, {sharding: config.sharding}, cluster_for(f"gpu-H100-{PROCESSES}x1"), seq_len, batch)
    rows = batch // (mesh["data"] * mesh["fsdp"] * mesh["expert"])
    stage_layers = len(layer_ranges(planner.layer_costs, mesh["pipe"], None)[0])
    return json.loads(out.read_text()), planner.collective_bytes(mesh, sharding, rows, stage_layers)


def _fsdp_sent(volumes: Volumes) -> float:
    return sum(volumes.get(kind, {}).get("sent", 0) for kind in ("all_gather", "reduce_scatter"))


@pytest.mark.slow
def test_fsdp_gathers_and_reduce_scatters_move_the_predicted_bytes(tmp_path, data_cache):
    measured, predicted = _measured_and_predicted(tmp_path, data_cache, "fsdp", "mesh.fsdp=2")
    # Gathered twice and reduce-scattered once: half of each of the debug model's 139,584 parameters.
    assert _fsdp_sent(measured[0]) == pytest.approx(predicted["fsdp"], rel=0.01)


@pytest.mark.slow
def test_tensor_parallel_all_reduces_move_the_predicted_bytes_and_the_head_stays_split(tmp_path, data_cache):
    measured, predicted = _measured_and_predicted(tmp_path, data_cache, "fsdp_tp", "mesh.model=2")
    # Per layer 2 all-reduces forward, 5 backward (q, k, v, gate, up each its own); the embedding's
    # all-reduce; the fused loss's per token maximum, sum and target logit and the hidden states'
    # gradient, the head never gathered. What remains is scalars: the gradient norm's partial sums
    # over split gradients, the loss's token count and sums.
    assert measured[0].keys() == {"all_reduce"}
    assert measured[0]["all_reduce"]["sent"] == pytest.approx(predicted["tensor parallel"], rel=0.01)


@pytest.mark.slow
def test_pipeline_stages_send_the_predicted_activations_and_gradients(tmp_path, data_cache):
    measured, predicted = _measured_and_predicted(tmp_path, data_cache, "fsdp", "mesh.pipe=2")
    # The first stage sends each micro-batch's activations on, the second their gradients back:
    # the same bytes, and nothing else of any size (the collectives left are the loss's scalars).
    for volumes in measured:
        assert volumes["send"]["sent"] == predicted["pipeline sends"]
    assert predicted.keys() == {"pipeline sends"}


@pytest.mark.slow
def test_expert_all_to_alls_exchange_the_predicted_rows(tmp_path, data_cache):
    measured, predicted = _measured_and_predicted(tmp_path, data_cache, "fsdp_ep", "mesh.expert=2", *MOE)
    uniform_share = (PROCESSES - 1) / PROCESSES  # of a process's rows, routed to the other's experts
    # Dispatch, combine and both their gradients: between them the processes exchange every
    # token's top-k rows 4 times per layer, however they are routed (the per-layer exchange of the
    # routing counts, 4 int64 each, is the remainder).
    exchanged = sum(volumes["all_to_all"]["contributed"] for volumes in measured)
    assert exchanged == pytest.approx(PROCESSES * predicted["expert all-to-all"] / uniform_share, rel=1e-4)
    # The share that leaves a process depends on the routing: near the planner's uniform guess.
    for volumes in measured:
        all_to_all = volumes["all_to_all"]
        assert all_to_all["sent"] / all_to_all["contributed"] == pytest.approx(uniform_share, rel=0.15)
    # The expert axis is data-parallel elsewhere: FSDP shards the other weights over it.
    assert _fsdp_sent(measured[0]) == pytest.approx(predicted["fsdp"], rel=0.01)
