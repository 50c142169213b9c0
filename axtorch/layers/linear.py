"""Linear projection: the primitive every block's matmuls are built from.

A linear may hold an ``adapter`` child (LoRA, ``model/adapter``) whose output adds to its own;
none by default. The model's adapter transform (``axtorch.models.adapter``) puts one into the
linears its target pattern names, so no block that contains linears knows about adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, cast, runtime_checkable

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


@runtime_checkable
class LinearAdapter(Protocol):
    """A trainable change to a frozen linear: an output added to the linear's, and the same change as a weight."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """What adds to ``x W^T + b`` (same shape as the linear's output)."""
        ...

    def delta_weight(self) -> torch.Tensor:
        """[out_features, in_features]: the change to ``weight`` that this adapter makes (in inference)."""
        ...


def plus_adapter(linear: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` (a linear's output on ``x``) plus its adapter's output, if it holds one: the one place
    any base linear (this one, the int8 frozen base's, float8's) adds its adapter."""
    adapter = cast(Optional[nn.Module], linear.adapter)
    return y if adapter is None else y + adapter(x)


class Linear(nn.Module):
    """``y = x W^T + b`` with ``weight`` of shape [out_features, in_features] (the HF layout)."""

    def __init__(self, config: LinearConfig, in_features: int, out_features: int):
        super().__init__()
        self.config = config
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if config.bias else None
        #: An nn.Module following ``LinearAdapter``, or None (the default: a plain linear).
        self.adapter: Optional[nn.Module] = None

    def reset_parameters(self) -> None:
        initialize(self.weight, self.config.init)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return plus_adapter(self, x, F.linear(x, self.weight, self.bias))

    @torch.no_grad()
    def merge_adapter(self) -> None:
        """Fold the adapter into ``weight`` and drop it: the same function, as a plain linear."""
        if self.adapter is None:
            return
        delta = cast(LinearAdapter, self.adapter).delta_weight()
        self.weight.copy_(self.weight + delta.to(self.weight.dtype))
        self.adapter = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
