"""MetricsLogger writes crash-safe strict JSONL plus TensorBoard; read_metrics resolves resumed runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from axtorch.train.metrics import MetricsLogger, read_metrics


def _strict_json_lines(path: Path) -> list[dict]:
    def reject(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant} in {path}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def _tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_each_line_is_flushed_with_step_first(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, enable_tensorboard=False)
    logger.log(1, {"train/loss": 2.5, "train/lr": 1e-3})
    logger.log(2, {"train/loss": torch.tensor(2.25), "train/tokens_per_s": 1000})
    # Read while the logger is still open: nothing may sit in a buffer.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [list(json.loads(line)) for line in lines] == [
        ["step", "train/loss", "train/lr"],
        ["step", "train/loss", "train/tokens_per_s"],
    ]
    assert json.loads(lines[1]) == {"step": 2, "train/loss": 2.25, "train/tokens_per_s": 1000.0}
    logger.close()
    assert not (tmp_path / "tensorboard").exists()


def test_non_finite_values_are_null_in_json_but_kept_in_tensorboard(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"train/loss": float("nan"), "train/grad_norm": float("inf")})
        logger.log(2, {"train/loss": 3.0, "train/grad_norm": 1.0})
    assert _strict_json_lines(tmp_path / "metrics.jsonl") == [
        {"step": 1, "train/loss": None, "train/grad_norm": None},
        {"step": 2, "train/loss": 3.0, "train/grad_norm": 1.0},
    ]
    loss = _tensorboard_scalars(tmp_path, "train/loss")
    assert [step for step, _ in loss] == [1, 2]
    assert math.isnan(loss[0][1]) and loss[1][1] == 3.0
    assert _tensorboard_scalars(tmp_path, "train/grad_norm")[0][1] == math.inf


def test_invalid_calls_are_rejected(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, enable_tensorboard=False) as logger:
        with pytest.raises(ValueError, match="reserved"):
            logger.log(1, {"step": 1.0})
        with pytest.raises(ValueError, match="non-negative int"):
            logger.log(-1, {"train/loss": 1.0})
        with pytest.raises(ValueError, match="non-negative int"):
            logger.log(1.0, {"train/loss": 1.0})  # type: ignore[arg-type]


def test_resume_from_earlier_checkpoint_keeps_the_last_written_entries(tmp_path: Path) -> None:
    # First run logs steps 1-5 (eval at 4) then crashes; the checkpoint was at step 2.
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"train/loss": 10.0 + step})
            if step == 4:
                logger.log(step, {"eval/loss": 20.0})
    with MetricsLogger(tmp_path) as logger:
        for step in range(3, 7):
            logger.log(step, {"train/loss": float(step)})
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records == [
        {"step": 1, "train/loss": 11.0},
        {"step": 2, "train/loss": 12.0},
        {"step": 3, "train/loss": 3.0},
        {"step": 4, "train/loss": 4.0},
        {"step": 5, "train/loss": 5.0},
        {"step": 6, "train/loss": 6.0},
    ]
    # TensorBoard hides the superseded events too.
    assert _tensorboard_scalars(tmp_path, "train/loss") == [
        (1, 11.0),
        (2, 12.0),
        (3, 3.0),
        (4, 4.0),
        (5, 5.0),
        (6, 6.0),
    ]


def test_same_step_lines_are_kept_unless_a_metric_repeats(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 9, "train/loss": 3.0},
        {"step": 10, "train/loss": 2.0},
        {"step": 10, "eval/loss": 2.5},  # same run: train and eval logged separately
        {"step": 10, "train/loss": 1.5},  # restart at step 10 (checkpoint after step 9)
        {"step": 11, "train/loss": 1.0},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert read_metrics(path) == [lines[0], lines[3], lines[4]]


def test_torn_last_line_is_ignored_and_cut_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/lo')
    assert read_metrics(path) == [{"step": 1, "train/loss": 2.0}]
    with MetricsLogger(tmp_path, enable_tensorboard=False) as logger:
        logger.log(2, {"train/loss": 1.0})
    assert _strict_json_lines(path) == [{"step": 1, "train/loss": 2.0}, {"step": 2, "train/loss": 1.0}]


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not valid JSON"):
        read_metrics(path)
    path.write_text('{"loss": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:1: expected a JSON object with an int 'step'"):
        read_metrics(path)
