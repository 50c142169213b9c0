"""The native backend under torchrun (gloo on CPU): loss parity with one device, real sharding,
and checkpoints that move between meshes."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from axtorch.config.compose import load_train_config
from axtorch.train.checkpoint import read_model_tensors
from axtorch.train.trainer import Trainer
from debug_runs import STEPS, debug_overrides, train_losses

WORKER = Path(__file__).with_name("native_worker.py")


def _torchrun(processes: int, out: Path, until: int, overrides: list[str]) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
               "--standalone", str(WORKER), str(out), str(until), *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(out.with_name(f"{out.name}.rank{r}.json").read_text()) for r in range(processes)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One single-device run and the distributed runs of the same experiment, STEPS steps each."""
    root = tmp_path_factory.mktemp("native")
    cache = root / "cache"
    Trainer(load_train_config(debug_overrides(root / "single", cache))).fit(until_step=STEPS)
    reports = {
        "fsdp2": _torchrun(2, root / "fsdp2", STEPS, debug_overrides(root / "fsdp2", cache, "backend=native",
                                                               "mesh.fsdp=2", "sharding=fsdp")),
        "fsdp2_tp2": _torchrun(4, root / "fsdp2_tp2", STEPS, debug_overrides(
            root / "fsdp2_tp2", cache, "backend=native", "mesh.fsdp=2", "mesh.model=2", "sharding=fsdp_tp")),
    }
    return root, reports


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_tp2"])
def test_losses_match_a_single_device(runs, name):
    root, _ = runs
    single, distributed = train_losses(root / "single"), train_losses(root / name)
    assert len(single) == len(distributed) == STEPS
    torch.testing.assert_close(torch.tensor(distributed), torch.tensor(single), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fsdp_holds_one_share_of_parameters_and_optimizer_state_per_rank(runs):
    _, reports = runs
    for report in reports["fsdp2"]:
        assert report["params_local"] * 2 == pytest.approx(report["params_total"], rel=0.01)
        assert report["optim_local"] * 2 == pytest.approx(report["optim_total"], rel=0.01)
    for report in reports["fsdp2_tp2"]:
        assert report["params_local"] * 4 == pytest.approx(report["params_total"], rel=0.02)


@pytest.mark.slow
def test_sharded_checkpoint_equals_the_single_device_one(runs):
    root, _ = runs
    name = f"step_{STEPS:08d}"
    expected = read_model_tensors(root / "single" / "checkpoints" / name)
    for run in ("fsdp2", "fsdp2_tp2"):
        checkpoint = root / run / "checkpoints" / name
        assert len(list(checkpoint.glob("model-*-of-*.safetensors"))) == (2 if run == "fsdp2" else 4)
        got = read_model_tensors(checkpoint)
        assert got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=f"{run}: {key}")


@pytest.mark.slow
def test_checkpoint_moves_between_meshes_and_training_continues_alike(runs, tmp_path):
    """fsdp=2 x model=2 (4 processes) -> fsdp=2 (2 processes) -> one device, 3 more steps each."""
    root, _ = runs
    cache = root / "cache"
    to_native = tmp_path / "to_native"
    to_single = tmp_path / "to_single"
    for target in (to_native, to_single):
        shutil.copytree(root / "fsdp2_tp2" / "checkpoints", target / "checkpoints")
    _torchrun(2, tmp_path / "resumed", STEPS + 3, debug_overrides(to_native, cache, "backend=native", "mesh.fsdp=2",
                                                              "sharding=fsdp"))
    Trainer(load_train_config(debug_overrides(to_single, cache))).fit()
    Trainer(load_train_config(debug_overrides(root / "single", cache))).fit()  # the uninterrupted reference
    reference = train_losses(root / "single")[-3:]
    torch.testing.assert_close(torch.tensor(train_losses(to_native)), torch.tensor(reference), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(train_losses(to_single)), torch.tensor(reference), rtol=1e-5, atol=1e-5)


def test_native_backend_rejects_a_mesh_that_does_not_fit_the_world(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         "-m", "axtorch.train", *debug_overrides(tmp_path / "run", tmp_path / "cache", "backend=native", "mesh.fsdp=4")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert "mesh axes fsdp=4 need 4 devices, found 2" in result.stderr
