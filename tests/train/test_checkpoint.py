import json

import pytest
import torch

from axtorch.train.checkpoint import Checkpointer, list_checkpoints, read_model_tensors
from axtorch.train.optimizer import OptimConfig, build_optimizer


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    optimizer = build_optimizer(model, OptimConfig())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_restores_parameters_and_optimizer_state(tmp_path, async_save):
    model, optimizer = _model_and_optimizer(0)
    checkpointer = Checkpointer(tmp_path, keep=2, async_save=async_save)
    path = checkpointer.save(7, model, optimizer, {"step": 7})
    checkpointer.wait()
    assert path.name == "step_00000007"
    assert json.loads((path / "trainer_state.json").read_text()) == {"step": 7}
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) == set(index["tensors"])

    other, other_optimizer = _model_and_optimizer(1)
    checkpointer.load(path, other, other_optimizer)
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), other.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], other_optimizer.state[q][key])


def test_async_save_snapshots_tensors_before_training_continues(tmp_path):
    model, optimizer = _model_and_optimizer()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer = Checkpointer(tmp_path, keep=1, async_save=True)
    path = checkpointer.save(1, model, optimizer, {})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    checkpointer.wait()
    saved = read_model_tensors(path)
    assert all(torch.equal(saved[k], v) for k, v in expected.items())


def test_keeps_only_the_newest_checkpoints_and_never_exposes_partial_ones(tmp_path):
    model, optimizer = _model_and_optimizer()
    checkpointer = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        checkpointer.save(step, model, optimizer, {"step": step})
    (tmp_path / ".step_00000004.tmp-123").mkdir()  # what a crash mid-write leaves behind
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert checkpointer.latest_valid().name == "step_00000003"


def test_checkpoint_files_are_safetensors_not_pickle(tmp_path):
    model, optimizer = _model_and_optimizer()
    path = Checkpointer(tmp_path, keep=1).save(1, model, optimizer, {})
    files = sorted(p.name for p in path.iterdir())
    assert files == [
        "manifest.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "optimizer.safetensors",
        "optimizer.safetensors.index.json",
        "trainer_state.json",
    ]
