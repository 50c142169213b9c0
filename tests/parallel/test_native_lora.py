"""LoRA on a sharded frozen base: FSDP2 (native backend, 2 gloo processes), FSDP2 with tensor
parallelism (4 processes, fsdp=2 x model=2) and XLA SPMD (fsdp=2).

FSDP2 shards the frozen base with the adapters, and tensor parallelism splits each adapter with its
base (``conf/sharding/fsdp_tp.yaml``); only the adapters get gradients and optimizer state. The
losses and the saved adapters equal one device's run of the same experiment, under both backends.
"""

import json
import re
from pathlib import Path

import pytest
import torch
from debug_runs import STEPS, debug_overrides, train_losses, train_on_one_device
from forked_ranks import run_ranks
from xla_runs import needs_xla, run_worker

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.checkpoint import read_index, read_model_tensors
from axtorch.train.trainer import build_model

pytestmark = pytest.mark.journey

WORKER = Path(__file__).with_name("native_worker.py")
LORA = ("model/adapter=lora", "model.adapter.target='(q|v|down)_proj'")


@pytest.mark.slow
def test_lora_under_fsdp_trains_as_one_device_does(tmp_path, data_cache):
    cache = data_cache
    train_on_one_device(tmp_path / "single", cache, *LORA)
    out = tmp_path / "fsdp2"
    overrides = debug_overrides(out, cache, "backend=native", "mesh.fsdp=2", "sharding=fsdp", *LORA)
    run_ranks(2, str(WORKER), str(out), str(STEPS), *overrides)
    reports = [json.loads(out.with_name(f"fsdp2.rank{r}.json").read_text()) for r in range(2)]
    assert [report["step"] for report in reports] == [STEPS, STEPS]
    for report in reports:  # each rank holds half of the base and of the adapters, and their moments only
        assert report["params_local"] * 2 == pytest.approx(report["params_total"], rel=0.02)
        assert report["optim_local"] * 2 == pytest.approx(report["optim_total"], rel=0.02)

    _assert_same_adapters(tmp_path / "single", out)


@pytest.mark.slow
def test_lora_under_fsdp_and_tensor_parallelism_trains_as_one_device_does(tmp_path, data_cache):
    """fsdp=2 x model=2: the adapters of column-parallel q/v split B's rows, those of row-parallel down A's columns."""
    cache = data_cache
    train_on_one_device(tmp_path / "single", cache, *LORA)
    out = tmp_path / "fsdp2_tp2"
    mesh = ("backend=native", "mesh.fsdp=2", "mesh.model=2", "sharding=fsdp_tp")
    run_ranks(4, str(WORKER), str(out), str(STEPS), *debug_overrides(out, cache, *mesh, *LORA))
    reports = [json.loads(out.with_name(f"fsdp2_tp2.rank{r}.json").read_text()) for r in range(4)]
    assert [report["step"] for report in reports] == [STEPS] * 4
    # A quarter of every tensor but those whole over `model`, of which half: the norms, and the
    # adapters' halves that tensor parallelism does not split (q and v's A, down's B).
    model = build_model(load_experiment_config(debug_overrides(out, cache, *LORA)), torch.device("cpu"))
    sizes = {name: parameter.numel() for name, parameter in model.named_parameters()}
    norms = sum(size for name, size in sizes.items() if re.fullmatch(r".*_norm\.(weight|bias)", name))
    whole_adapters = r".*((q|v)_proj\.adapter\.lora_a|down_proj\.adapter\.lora_b)"
    adapters = sum(size for name, size in sizes.items() if re.fullmatch(whole_adapters, name))
    assert norms and adapters == 2 * (8 * 64 * 2 + 64 * 8)  # 2 layers of (q, v: A [8, 64]; down: B [64, 8])
    for report in reports:
        assert report["params_local"] * 4 == report["params_total"] + norms + adapters
        assert report["optim_local"] * 4 == report["optim_total"] + 2 * adapters  # AdamW's two moments
    _assert_same_adapters(tmp_path / "single", out)


@pytest.mark.slow
@needs_xla
@pytest.mark.parametrize(
    ("devices", "mesh"),
    [
        (2, ("mesh.fsdp=2", "sharding=fsdp", "execution.layer_runner=unrolled")),
        (2, ("mesh.fsdp=2", "sharding=fsdp", "execution.layer_runner=scan")),
        (4, ("mesh.fsdp=2", "mesh.model=2", "sharding=fsdp_tp")),
    ],
    ids=["fsdp", "fsdp-scan", "fsdp_tp"],
)
def test_lora_under_xla_sharding_trains_as_one_device_does(tmp_path, data_cache, devices, mesh):
    """Unrolled, scanned over stacked layers (whose frozen stacks keep no gradients), and tensor-parallel."""
    cache = data_cache
    train_on_one_device(tmp_path / "single", cache, *LORA)
    out = tmp_path / "xla"
    run_worker(devices, tmp_path / "xla.json", STEPS, debug_overrides(out, cache, *mesh, *LORA))
    _assert_same_adapters(tmp_path / "single", out)


def _assert_same_adapters(single_run: Path, run: Path) -> None:
    """The same losses as ``single_run``, and a checkpoint of the same adapters and their moments only."""
    single, distributed = train_losses(single_run), train_losses(run)
    assert len(single) == len(distributed) == STEPS
    torch.testing.assert_close(torch.tensor(distributed), torch.tensor(single), rtol=1e-5, atol=1e-5)
    name = f"step_{STEPS:08d}"
    expected = read_model_tensors(single_run / "checkpoints" / name)
    got = read_model_tensors(run / "checkpoints" / name)
    assert sorted(got) == sorted(expected)
    assert all(".adapter.lora_" in key for key in got) and len(got) == 3 * 2 * 2  # q, v, down; A, B; 2 layers
    # Adam divides each gradient by its own running scale, so where an element's gradient is near
    # zero (B starts at zero, so A's early gradients are tiny), a float32 summation order moves its
    # update by up to lr / eps times the rounding: a few elements of a run on other devices then
    # differ by some 1e-6 (5.6e-6 seen, the debug lr being 3e-3). A wrong gradient moves whole
    # tensors by about lr, so beyond the bound every tensor keeps all but a few elements within 1e-6.
    for key in expected:
        torch.testing.assert_close(
            got[key], expected[key], rtol=1e-4, atol=5e-5, msg=lambda message, key=key: f"{key}: {message}"
        )
        off = ((got[key] - expected[key]).abs() > 1e-6 + 1e-4 * expected[key].abs()).float().mean().item()
        assert off < 0.05, f"{key}: {off:.1%} of its elements differ by more than 1e-6"
    moments = {name.rsplit("/", 1)[0] for name in read_index(run / "checkpoints" / name, "optimizer")}
    assert moments == set(got)
