"""Normalisation layers. ``NormConfig`` is the slot type; each subclass builds one norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class NormConfig:
    """Slot type for a normalisation layer; concrete configs build with ``build(dim)``."""

    eps: float = 1e-6

    def build(self, dim: int) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete norm config")

    def saved_width(self, width: float) -> float:
        """Values per token that its backward keeps, input and output included, for ``width`` features
        (``axtorch.plan.memory``: measured by the dry run)."""
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete norm config")


@dataclass
class RMSNormConfig(NormConfig):
    def build(self, dim: int) -> RMSNorm:
        return RMSNorm(self, dim)

    def saved_width(self, width: float) -> float:
        return 3 * width  # the input, the normalised input (for the gain's gradient), the output


@dataclass
class LayerNormConfig(NormConfig):
    eps: float = 1e-5
    bias: bool = True

    def build(self, dim: int) -> LayerNorm:
        return LayerNorm(self, dim)

    def saved_width(self, width: float) -> float:
        return 2 * width  # the input and the output (torch's fused kernel keeps per-token statistics)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 whatever the input dtype (as Llama does)."""

    def __init__(self, config: RMSNormConfig, dim: int):
        super().__init__()
        self.eps = config.eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32 and not torch.is_grad_enabled():
            # Inference in float32 (decoding: two norms a layer a token): torch's one call, the
            # same values bit for bit as the steps below, without their per-op overhead.
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        compute = torch.promote_types(x.dtype, torch.float32)
        h = x.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)


class LayerNorm(nn.Module):
    """Mean-and-variance norm with optional bias (GPT-2 style)."""

    def __init__(self, config: LayerNormConfig, dim: int):
        super().__init__()
        self.eps = config.eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim)) if config.bias else None

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
