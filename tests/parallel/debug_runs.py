"""The short debug experiment that every backend test runs, and how to read its losses back."""

from pathlib import Path

from quiet_runs import quiet_debug_run

from axtorch.compose.experiment import load_experiment_config
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


def train_losses(run_dir: Path) -> list[float]:
    return [m["train/loss"] for m in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in m]
