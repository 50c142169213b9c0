"""The native backend on several gloo ranks: loss parity with one device, real sharding,
and checkpoints that move between meshes."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from debug_runs import STEPS, assert_weights_match_one_device, debug_overrides, train_losses, train_on_one_device
from forked_ranks import run_ranks
from torchrun_runs import TORCHRUN_EXECUTABLE

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.layers.transformer import TransformerLayerInput, TransformerLayerOutput
from axtorch.models.causal_lm import CausalLMOutput
from axtorch.train.checkpoint import read_model_tensors
from axtorch.train.metrics import read_metrics
from axtorch.train.trainer import Trainer

pytestmark = pytest.mark.journey

WORKER = Path(__file__).with_name("native_worker.py")


def train_on_ranks(processes: int, out: Path, until: int, overrides: list[str]) -> list[dict]:
    run_ranks(processes, str(WORKER), str(out), str(until), *overrides)
    return [json.loads(out.with_name(f"{out.name}.rank{r}.json").read_text()) for r in range(processes)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """One single-device run and the distributed runs of the same experiment, STEPS steps each."""
    root = tmp_path_factory.mktemp("native")
    cache = data_cache
    train_on_one_device(root / "single", cache)
    # Plain fsdp=2 runs in the kill, preemption and launcher tests; here FSDP is in every row.
    reports = {
        "fsdp2_tp2": train_on_ranks(
            4,
            root / "fsdp2_tp2",
            STEPS,
            debug_overrides(
                root / "fsdp2_tp2", cache, "backend=native", "mesh.fsdp=2", "mesh.model=2", "sharding=fsdp_tp"
            ),
        ),
        # Tensor parallelism alone: DTensor weights beside plain-tensor norms in one optimizer.
        "tp2": train_on_ranks(
            2,
            root / "tp2",
            STEPS,
            debug_overrides(root / "tp2", cache, "backend=native", "mesh.model=2", "sharding=fsdp_tp"),
        ),
        # Context parallelism: each sequence split over 2 processes, FSDP over fsdp x seq.
        "fsdp2_seq2": train_on_ranks(
            4,
            root / "fsdp2_seq2",
            STEPS,
            debug_overrides(root / "fsdp2_seq2", cache, "backend=native", "mesh.fsdp=2", "mesh.seq=2"),
        ),
        # Pipeline: 2 stages of one layer, each sharded over fsdp=2 (1F1B, 4 micro-batches).
        "pp2_fsdp2": train_on_ranks(
            4,
            root / "pp2_fsdp2",
            STEPS,
            debug_overrides(root / "pp2_fsdp2", cache, "backend=native", "mesh.pipe=2", "mesh.fsdp=2", "sharding=fsdp"),
        ),
        # HSDP: sharded within each of 2 groups, replicated across them.
        "hsdp": train_on_ranks(
            4,
            root / "hsdp",
            STEPS,
            debug_overrides(root / "hsdp", cache, "backend=native", "mesh.data=2", "mesh.fsdp=2"),
        ),
    }
    return root, reports


def test_fsdp2_sees_the_tensors_of_sharded_modules_inputs_and_outputs():
    """Before torch 2.11, FSDP2 hooks backward only onto tensors that pytree finds; newer torch
    also looks into dataclasses, so there the parity runs below would not miss a registration."""
    x = torch.ones(1, requires_grad=True)
    for value in (TransformerLayerInput(x, x), TransformerLayerOutput(x), CausalLMOutput(x)):
        assert any(leaf is x for leaf in torch.utils._pytree.tree_leaves(value)), type(value).__name__


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2_tp2", "tp2", "fsdp2_seq2", "hsdp", "pp2_fsdp2"])
def test_losses_and_gradient_norms_match_a_single_device(runs, name):
    """The norms too: each mesh sums its shards' squares by one all-reduce (shards held by several
    processes, as HSDP's replicas or tensor parallelism's whole norms are, counted once), where one
    device's is torch's ``clip_grad_norm_``."""
    root, _ = runs
    for key in ("train/loss", "train/grad_norm"):
        single, distributed = train_losses(root / "single", key), train_losses(root / name, key)
        assert len(single) == len(distributed) == STEPS
        torch.testing.assert_close(
            torch.tensor(distributed), torch.tensor(single), rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
        )


@pytest.mark.slow
def test_fsdp_holds_one_share_of_parameters_and_optimizer_state_per_rank(runs):
    _, reports = runs
    for report in reports["hsdp"]:  # sharded over fsdp=2 only: the data groups hold the same halves
        assert report["params_local"] * 2 == pytest.approx(report["params_total"], rel=0.01)
        assert report["optim_local"] * 2 == pytest.approx(report["optim_total"], rel=0.01)
    for report in reports["fsdp2_tp2"] + reports["fsdp2_seq2"]:
        assert report["params_local"] * 4 == pytest.approx(report["params_total"], rel=0.02)


@pytest.mark.slow
def test_sharded_checkpoint_equals_the_single_device_one(runs):
    root, _ = runs
    name = f"step_{STEPS:08d}"
    for run in ("fsdp2_tp2", "fsdp2_seq2", "hsdp", "pp2_fsdp2"):
        checkpoint = root / run / "checkpoints" / name
        assert len(list(checkpoint.glob("model-*-of-*.safetensors"))) == 4
        assert_weights_match_one_device(checkpoint, root / "single" / "checkpoints" / name, run)


@pytest.mark.slow
def test_checkpoint_moves_between_meshes_and_training_continues_alike(runs, tmp_path, data_cache):
    """fsdp=2 x model=2 -> 2 pipeline stages x fsdp=2, and those stages -> one device; 3 more steps each."""
    root, _ = runs
    cache = data_cache
    to_native = tmp_path / "to_native"
    to_single = tmp_path / "to_single"
    shutil.copytree(root / "fsdp2_tp2" / "checkpoints", to_native / "checkpoints")
    shutil.copytree(root / "pp2_fsdp2" / "checkpoints", to_single / "checkpoints")
    train_on_ranks(
        4,
        tmp_path / "resumed",
        STEPS + 3,
        debug_overrides(to_native, cache, "backend=native", "mesh.pipe=2", "mesh.fsdp=2", "sharding=fsdp"),
    )
    Trainer(load_experiment_config(debug_overrides(to_single, cache))).fit()
    Trainer(load_experiment_config(debug_overrides(root / "single", cache))).fit()  # the uninterrupted reference
    reference = train_losses(root / "single")[-3:]
    torch.testing.assert_close(torch.tensor(train_losses(to_native)), torch.tensor(reference), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(train_losses(to_single)), torch.tensor(reference), rtol=1e-5, atol=1e-5)


def test_launcher_runs_native_training_and_rejects_a_mesh_that_does_not_fit(tmp_path, data_cache):
    """launch/torchrun_single_node.sh with 2 CPU processes: a run that fits, and one that does not."""
    launcher = Path(__file__).resolve().parents[2] / "launch" / "torchrun_single_node.sh"
    env = {**os.environ, "NPROC": "2", "TORCHRUN": str(TORCHRUN_EXECUTABLE)}

    def launch(run: str, *extra: str) -> subprocess.CompletedProcess:
        overrides = debug_overrides(tmp_path / run, data_cache, "backend=native", *extra)
        return subprocess.run([str(launcher), *overrides], capture_output=True, text=True, timeout=300, env=env)

    fits = launch("fits", "mesh.fsdp=2", "sharding=fsdp")
    assert fits.returncode == 0, fits.stderr[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "fits" / "metrics.jsonl") if "train/loss" in m] == list(
        range(1, STEPS + 4)
    )
    too_big = launch("too_big", "mesh.fsdp=4")
    assert too_big.returncode != 0
    assert "mesh axes fsdp=4 need 4 devices, found 2" in too_big.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "report_key", "expected", "tolerance"),
    [
        # The layers compute with bf16 weights that FSDP gathered (half the bytes); the losses follow
        # a one-device bf16-autocast run to bf16 rounding.
        ("trainer.precision=bf16", "compute_weight_dtype", "torch.bfloat16", 2e-3),
        # FSDP gathers the fp32 weights of torchao's float8 linears. Each process scales its own
        # activations (a per-tensor amax over its half of the batch), so the losses follow one
        # device's float8 run to float8 rounding (2.4e-3 by step 5; tests/models/test_float8.py
        # holds float8 within 5e-3 of fp32), not bit for bit.
        ("model/float8=tensorwise", "linear_class", "Float8Linear", 5e-3),
    ],
    ids=["bf16", "float8"],
)
def test_a_low_precision_policy_shards_with_fsdp_and_trains_as_one_device_does(
    tmp_path, data_cache, override, report_key, expected, tolerance
):
    """Under fsdp=2 the layers compute as the policy says, the checkpoint and the optimizer stay fp32."""
    if override.startswith("model/float8"):
        pytest.importorskip("torchao.float8")
    cache = data_cache
    # One held-out batch, not four: the evaluations (before the first step and at the stop) are
    # not compared here and were most of the time (while CPU float8 matmuls ran torch's ~0.2 s kernel).
    policy = (*override.split(), "trainer.eval_batches=1")
    train_on_one_device(tmp_path / "single", cache, *policy)
    reports = train_on_ranks(
        2,
        tmp_path / "fsdp2",
        STEPS,
        debug_overrides(tmp_path / "fsdp2", cache, "backend=native", "mesh.fsdp=2", "sharding=fsdp", *policy),
    )
    assert {report[report_key] for report in reports} == {expected}
    single, distributed = train_losses(tmp_path / "single"), train_losses(tmp_path / "fsdp2")
    torch.testing.assert_close(torch.tensor(distributed), torch.tensor(single), rtol=0, atol=tolerance)
    state = read_model_tensors(tmp_path / "fsdp2" / "checkpoints" / f"step_{STEPS:08d}")
    assert {tensor.dtype for tensor in state.values()} == {torch.float32}
