"""Linear projection: the primitive every block's matmuls are built from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from axtorch.layers.init import InitConfig, initialize


@dataclass
class LinearConfig:
    bias: bool = False
    init: InitConfig = field(default_factory=InitConfig)

    def build(self, in_features: int, out_features: int) -> Linear:
        return Linear(self, in_features, out_features)


class Linear(nn.Module):
    """``y = x W^T + b`` with ``weight`` of shape [out_features, in_features] (the HF layout)."""

    def __init__(self, config: LinearConfig, in_features: int, out_features: int):
        super().__init__()
        self.config = config
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if config.bias else None

    def reset_parameters(self) -> None:
        initialize(self.weight, self.config.init)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
