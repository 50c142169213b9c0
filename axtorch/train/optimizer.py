"""AdamW with decoupled weight decay and a name-pattern no-decay set."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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


#: Devices whose fused AdamW kernel (one kernel over every parameter) this project runs: on the
#: CPU it steps 3 to 8 times faster than the foreach kernels, and it can drop a step by a flag on
#: the device (``found_inf``) without the host reading anything first. torch_xla has none.
FUSED_DEVICES = ("cpu", "cuda")


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``parameter_groups``, fused where the parameters' device has the kernel; the lr
    is set by the trainer each step from the schedule."""
    beta1, beta2 = config.betas  # validate() checked that there are two
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    fused = device.type in FUSED_DEVICES
    groups = parameter_groups(model, config)
    return torch.optim.AdamW(
        _one_kind_per_group(groups) if fused else groups,
        lr=config.lr,
        betas=(beta1, beta2),
        eps=config.eps,
        foreach=None if fused else True,
        fused=fused or None,
    )


def _one_kind_per_group(groups: list[dict]) -> list[dict]:
    """Each group split into its DTensors and its plain tensors: fused AdamW steps a group in one
    call, which takes one kind (tensor parallelism without FSDP leaves the norms plain tensors)."""
    split = []
    for group in groups:
        for distributed in (False, True):
            kept = [(n, p) for n, p in zip(group["names"], group["params"]) if isinstance(p, DTensor) == distributed]
            if kept:
                split.append({**group, "names": [n for n, _ in kept], "params": [p for _, p in kept]})
    return split
