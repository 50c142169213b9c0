"""Learning-rate schedules as pure functions of the step (nothing to checkpoint)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from axtorch.config.errors import ConfigError


class ScheduleKind(enum.Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


@dataclass
class ScheduleConfig:
    """Linear warmup from 0 to the peak lr, then decay to ``min_lr_ratio * lr`` at the last step."""

    kind: ScheduleKind = ScheduleKind.cosine
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1

    def validate(self, key: str = "optim.schedule") -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"{key}.warmup_steps", self.warmup_steps, "a non-negative integer")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"{key}.min_lr_ratio", self.min_lr_ratio, "a ratio in [0, 1]")


def learning_rate(config: ScheduleConfig, peak_lr: float, step: int, total_steps: int) -> float:
    """The lr for optimizer step ``step`` (0-based) of ``total_steps``."""
    if step < config.warmup_steps:
        return peak_lr * (step + 1) / config.warmup_steps
    if config.kind is ScheduleKind.constant:
        return peak_lr
    decay_steps = max(total_steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / decay_steps, 1.0)
    factor = 0.5 * (1.0 + math.cos(math.pi * progress)) if config.kind is ScheduleKind.cosine else 1.0 - progress
    min_lr = peak_lr * config.min_lr_ratio
    return min_lr + (peak_lr - min_lr) * factor
