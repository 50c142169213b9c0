"""LoRA (Hu et al., 2021): a frozen linear's weight changes by a trainable low-rank ``B A``.

``model/adapter=lora`` gives each target linear (``axtorch.models.adapter``) the child ``LoRA``:
``y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T`` with ``A`` [rank, in] drawn as
``nn.Linear`` draws its weight (Kaiming-uniform, as peft) and ``B`` [out, rank] zero, so training
starts from the base model's function exactly. The parameters are ``<linear>.adapter.lora_a``
and ``.lora_b``; ``delta_weight`` is ``(alpha / rank) B A``, which export folds into ``W``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.models.adapter import AdapterConfig


@dataclass
class LoRAConfig(AdapterConfig):
    """``model.adapter`` for LoRA: the rank of the update, its scale ``alpha / rank``, dropout on its input."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0

    def validate(self, key: str = "model.adapter") -> None:
        super().validate(key)
        if self.rank <= 0:
            raise ConfigError(f"{key}.rank", self.rank, "a positive integer")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{key}.dropout", self.dropout, "a probability in [0, 1)")

    def build_adapter(self, in_features: int, out_features: int) -> LoRA:
        return LoRA(self, in_features, out_features)


class LoRA(nn.Module):
    """The low-rank update of one linear (a ``LinearAdapter``)."""

    def __init__(self, config: LoRAConfig, in_features: int, out_features: int):
        super().__init__()
        self.config = config
        self.scale = config.alpha / config.rank
        self.lora_a = nn.Parameter(torch.empty(config.rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, config.rank))

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.dropout and self.training:  # as peft, no dropout op at all at 0 (nor on DTensors under TP)
            x = F.dropout(x, self.config.dropout)
        return F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_b @ self.lora_a) * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.config.rank}, alpha={self.config.alpha}, dropout={self.config.dropout}"
