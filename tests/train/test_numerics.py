"""A non-finite loss or gradient norm: the update is dropped (``skip``) or the run saves and stops (``stop``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.checkpoint import checkpoint_problems, read_model_tensors
from axtorch.train.numerics import NonFiniteError
from axtorch.train.trainer import Trainer


def _trainer(run_dir: Path, cache: Path, *extra: str) -> Trainer:
    return Trainer(
        load_experiment_config(
            [
                "experiment=debug",
                f"run_dir={run_dir}",
                f"data.cache_dir={cache}",
                "trainer.progress_bar=false",
                "trainer.plot=false",
                "trainer.max_steps=8",
                "trainer.checkpoint_every=100",
                "trainer.eval_every=100",
                "trainer.log_every=1",
                *extra,
            ]
        )
    )


def _poison(trainer: Trainer, bad_steps: set[int]) -> None:
    """Make the loss NaN during the given (1-based) steps, as a diverging model or a bad batch would."""
    compute = trainer.work.loss_fn.forward

    def forward(inputs):
        output = compute(inputs)
        if trainer.step + 1 in bad_steps:
            output.loss = output.loss * float("nan")
            output.cross_entropy = output.cross_entropy * float("nan")
        return output

    trainer.work.loss_fn.forward = forward


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_skip_drops_the_bad_update_logs_it_and_trains_on(tmp_path, data_cache):
    trainer = _trainer(tmp_path / "run", data_cache)
    _poison(trainer, {4})
    before = {}

    step = trainer.train_step

    def train_step(batch):
        if trainer.step == 3:
            before.update({k: v.clone() for k, v in trainer.model.state_dict().items()})
        result = step(batch)
        if trainer.step == 4:
            for name, value in trainer.model.state_dict().items():
                assert torch.equal(value, before[name]), name  # the update was not applied
        return result

    trainer.train_step = train_step
    result = trainer.fit()
    assert result.step == 8
    records = _records(tmp_path / "run")
    events = [r for r in records if "nonfinite/skipped_update" in r]
    assert [e["step"] for e in events] == [4] and events[0]["nonfinite/loss"] is None  # NaN is JSON null
    assert all(r["train/loss"] is not None for r in records if "train/loss" in r)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_too_many_skips_in_a_row_stop_the_run(tmp_path, data_cache):
    trainer = _trainer(tmp_path / "run", data_cache, "trainer.max_nonfinite_skips=2")
    _poison(trainer, {3, 4, 5, 6})
    with pytest.raises(NonFiniteError, match=r"3 non-finite steps in a row.*max_nonfinite_skips=2"):
        trainer.fit()


def test_stop_saves_the_last_good_state_and_raises(tmp_path, data_cache):
    trainer = _trainer(tmp_path / "run", data_cache, "trainer.nonfinite=stop")
    _poison(trainer, {4})
    with pytest.raises(NonFiniteError, match=r"step 4: loss nan.*saved the last good state at step 3"):
        trainer.fit()
    saved = tmp_path / "run" / "checkpoints" / "step_00000003"
    assert checkpoint_problems(saved) == []
    assert [r["step"] for r in _records(tmp_path / "run") if "nonfinite/stopped" in r] == [3]
    clean = _trainer(tmp_path / "clean", data_cache)
    clean.fit(until_step=3)
    expected = read_model_tensors(tmp_path / "clean" / "checkpoints" / "step_00000003")
    for name, value in read_model_tensors(saved).items():
        assert torch.equal(value, expected[name]), name
