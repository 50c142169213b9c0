"""AdamW with decoupled weight decay and a name-pattern no-decay set."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.train.schedule import ScheduleConfig


@dataclass
class OptimConfig:
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    #: fnmatch patterns over parameter names that get no weight decay.
    no_decay: list[str] = field(default_factory=lambda: ["*norm.weight", "*norm.bias", "*.bias", "embedding.weight"])
    #: Clip gradients to this global L2 norm; None disables clipping (the norm is still reported).
    grad_clip_norm: Optional[float] = 1.0
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    def validate(self, key: str = "optim") -> None:
        if self.lr <= 0:
            raise ConfigError(f"{key}.lr", self.lr, "a positive float")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"{key}.betas", list(self.betas), "two floats in [0, 1)")
        if self.weight_decay < 0:
            raise ConfigError(f"{key}.weight_decay", self.weight_decay, "a non-negative float")
        if self.grad_clip_norm is not None and self.grad_clip_norm <= 0:
            raise ConfigError(f"{key}.grad_clip_norm", self.grad_clip_norm, "a positive float or null")
        self.schedule.validate(f"{key}.schedule")


def parameter_groups(model: nn.Module, config: OptimConfig) -> list[dict]:
    """Split parameters into a decayed and a non-decayed group; each group carries its names."""
    decay: list[tuple[str, nn.Parameter]] = []
    no_decay: list[tuple[str, nn.Parameter]] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        exempt = any(fnmatch.fnmatchcase(name, pattern) for pattern in config.no_decay)
        (no_decay if exempt else decay).append((name, param))
    return [
        {"names": [n for n, _ in group], "params": [p for _, p in group], "weight_decay": wd}
        for group, wd in ((decay, config.weight_decay), (no_decay, 0.0))
        if group
    ]


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``parameter_groups``; the lr is set by the trainer each step from the schedule."""
    beta1, beta2 = config.betas  # validate() checked that there are two
    return torch.optim.AdamW(
        parameter_groups(model, config),
        lr=config.lr,
        betas=(beta1, beta2),
        eps=config.eps,
        foreach=True,
    )
