"""End to end on the CPU: a tiny run learns, writes its artefacts, and resumes bit-identically."""

import json
import math

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.checkpoint import read_model_tensors
from axtorch.train.trainer import Trainer


def _config(run_dir, data_cache, *overrides):
    return load_experiment_config(
        [
            "experiment=debug",
            f"run_dir={run_dir}",
            f"data.cache_dir={data_cache}",
            "trainer.progress_bar=false",
            *overrides,
        ]
    )


def test_tiny_run_learns_and_writes_its_run_directory(tmp_path, data_cache):
    result = Trainer(_config(tmp_path / "run", data_cache, "trainer.max_steps=30")).fit()
    assert result.step == 30
    assert result.final_eval_loss < result.initial_eval_loss - 0.5
    run = tmp_path / "run"
    for name in ("config.yaml", "metrics.jsonl", "loss.png", "tokenizer.json"):
        assert (run / name).is_file(), name
    assert any((run / "tensorboard").iterdir())
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_00000010",
        "step_00000020",
        "step_00000030",
    ]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    for key in ("train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu", "train/memory_gb"):
        assert all(math.isfinite(r[key]) for r in train), key
    assert train[-1]["train/loss"] < train[0]["train/loss"]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, data_cache, accumulation):
    overrides = [
        f"trainer.grad_accum_steps={accumulation}",
        "trainer.max_steps=16",
        "trainer.checkpoint_every=8",
        "model.decoder.layer.attention.dropout=0.1",
    ]
    straight = Trainer(_config(tmp_path / "straight", data_cache, *overrides))
    straight.fit()

    first = Trainer(_config(tmp_path / "resumed", data_cache, *overrides))
    assert first.fit(until_step=8).step == 8
    second = Trainer(_config(tmp_path / "resumed", data_cache, *overrides))
    assert second.fit().step == 16

    expected = read_model_tensors(tmp_path / "straight" / "checkpoints" / "step_00000016")
    got = read_model_tensors(tmp_path / "resumed" / "checkpoints" / "step_00000016")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def _recording_steps(trainer: Trainer) -> list[dict[str, float]]:
    """The metrics of every ``train_step`` the trainer runs, in order."""
    steps: list[dict[str, float]] = []
    train_step = trainer.train_step

    def recorded(batch):
        steps.append(train_step(batch))
        return steps[-1]

    trainer.train_step = recorded  # type: ignore[method-assign]
    return steps


def test_gradient_accumulation_matches_the_full_batch(tmp_path, data_cache):
    one = Trainer(_config(tmp_path / "one", data_cache, "trainer.max_steps=3", "trainer.eval_every=100"))
    four = Trainer(
        _config(
            tmp_path / "four", data_cache, "trainer.max_steps=3", "trainer.grad_accum_steps=4", "trainer.eval_every=100"
        )
    )
    one_steps, four_steps = _recording_steps(one), _recording_steps(four)
    one.fit()
    four.fit()
    # The gradient is what accumulation must reproduce: every step's loss and global gradient
    # norm (a micro-batch weighed by its own targets rather than the batch's shows here; AdamW's
    # update below would hide a uniform scale).
    assert len(one_steps) == len(four_steps) == 3
    for a, b in zip(one_steps, four_steps):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    # Summing four micro-batches rounds differently from one batch, and AdamW divides by sqrt(v):
    # where gradients are near eps (lm_head rows of tokens the batch barely touches) that rounding
    # comes out at a fraction of the learning rate (3e-3 here) per step.
    for (name, a), (_, b) in zip(one.model.named_parameters(), four.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


def test_resuming_with_a_different_model_is_refused(tmp_path, data_cache):
    from axtorch.config.errors import ConfigError

    Trainer(_config(tmp_path / "run", data_cache, "trainer.max_steps=2")).fit()
    saved_config = (tmp_path / "run" / "config.yaml").read_text()
    other = Trainer(_config(tmp_path / "run", data_cache, "trainer.max_steps=4", "model.dim=128"))
    with pytest.raises(ConfigError, match="different model"):
        other.fit()
    assert (tmp_path / "run" / "config.yaml").read_text() == saved_config  # the run directory is untouched


def test_without_held_out_data_the_run_says_so_instead_of_scoring_zero(tmp_path, data_cache, capsys):
    result = Trainer(_config(tmp_path / "run", data_cache, "data.val_fraction=0.0", "trainer.max_steps=10")).fit()
    assert result.step == 10
    assert result.initial_eval_loss is None and result.final_eval_loss is None
    assert "no held-out data (data.val_fraction=0.0)" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not any("eval/loss" in r for r in records) and any("train/loss" in r for r in records)
