"""Next-token cross-entropy with an ignore index and optional z-loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from axtorch.config.errors import ConfigError

IGNORE_INDEX = -100


@dataclass
class CrossEntropyLossConfig:
    ignore_index: int = IGNORE_INDEX
    #: Weight of the z-loss ``mean(logsumexp(logits)^2)`` (PaLM uses 1e-4); 0 disables it.
    z_loss_weight: float = 0.0

    def validate(self, key: str = "loss") -> None:
        if self.z_loss_weight < 0:
            raise ConfigError(f"{key}.z_loss_weight", self.z_loss_weight, "a non-negative float")

    def build(self) -> CrossEntropyLoss:
        return CrossEntropyLoss(self)


@dataclass
class LossInput:
    logits: torch.Tensor  # [B, S, V]
    labels: torch.Tensor  # [B, S], IGNORE_INDEX where no loss is taken
    #: Divide summed losses by this many tokens instead of the tokens in this batch. Gradient
    #: accumulation and data parallelism pass the global count so that every token weighs the same.
    num_target_tokens: Optional[torch.Tensor] = None


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to differentiate: cross-entropy + z-loss, per target token
    cross_entropy: torch.Tensor  # scalar, per target token
    z_loss: torch.Tensor  # scalar, per target token (zero when disabled)
    num_tokens: torch.Tensor  # target tokens in this batch


class CrossEntropyLoss(nn.Module):
    """Token-averaged cross-entropy computed in float32, whatever the logits' dtype."""

    def __init__(self, config: CrossEntropyLossConfig):
        super().__init__()
        self.config = config

    def forward(self, inputs: LossInput) -> LossOutput:
        logits = inputs.logits.flatten(0, -2)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        labels = inputs.labels.flatten()
        valid = labels != self.config.ignore_index
        num_tokens = valid.sum()
        normalizer = (inputs.num_target_tokens if inputs.num_target_tokens is not None else num_tokens).clamp(min=1)
        cross_entropy = F.cross_entropy(logits, labels, ignore_index=self.config.ignore_index, reduction="sum")
        cross_entropy = cross_entropy / normalizer
        if self.config.z_loss_weight > 0:
            log_z = torch.logsumexp(logits, dim=-1)
            z_loss = self.config.z_loss_weight * (log_z.pow(2) * valid).sum() / normalizer
        else:
            z_loss = torch.zeros((), dtype=logits.dtype, device=logits.device)
        return LossOutput(
            loss=cross_entropy + z_loss, cross_entropy=cross_entropy, z_loss=z_loss, num_tokens=num_tokens
        )
