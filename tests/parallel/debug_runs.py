"""The short debug experiment that every backend test runs, and how to read its losses back."""

from pathlib import Path

import torch
from quiet_runs import quiet_debug_run

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.checkpoint import read_model_tensors
from axtorch.train.metrics import read_metrics
from axtorch.train.trainer import Trainer

#: Steps before the checkpoint that the cross-mesh tests resume from (3 more follow).
STEPS = 5


def debug_overrides(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    """The quiet debug run, every step logged, checkpointed at ``STEPS`` of ``STEPS + 3``."""
    steps = [f"trainer.max_steps={STEPS + 3}", "trainer.eval_every=100", f"trainer.checkpoint_every={STEPS}"]
    return quiet_debug_run(run_dir, cache, "trainer.log_every=1", *steps, *extra)


def train_on_one_device(run_dir: Path, cache: Path, *extra: str) -> None:
    """The single-device baseline that every backend's losses are compared with."""
    Trainer(load_experiment_config(debug_overrides(run_dir, cache, *extra))).fit(until_step=STEPS)


def train_losses(run_dir: Path, key: str = "train/loss") -> list[float]:
    """``key`` of every logged training step (the loss by default; ``train/grad_norm``, ...)."""
    return [m[key] for m in read_metrics(run_dir / "metrics.jsonl") if key in m]


def assert_weights_match_one_device(checkpoint: Path, reference: Path, label: str) -> None:
    """The model tensors of ``checkpoint`` equal those of one device's ``reference`` checkpoint.

    Within 1e-4: AdamW divides by sqrt(v), so where a row's gradients are near eps (an embedding
    row of a token the batches barely hold) the meshes' different summation orders come out at a
    fraction of the learning rate (3e-3). The losses, compared within 1e-5, check the gradients.
    """
    got, expected = read_model_tensors(checkpoint), read_model_tensors(reference)
    assert got.keys() == expected.keys(), label
    for key, value in expected.items():
        torch.testing.assert_close(
            got[key], value, rtol=1e-4, atol=1e-4, msg=lambda detail, key=key: f"{label}: {key}: {detail}"
        )
