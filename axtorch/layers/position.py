"""Position encodings applied inside attention. ``PositionConfig`` is the slot type."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class PositionConfig:
    """Slot type for the position encoding of queries and keys; build with ``build(head_dim)``."""

    def build(self, head_dim: int) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete position config")


@dataclass
class RotaryEmbeddingConfig(PositionConfig):
    theta: float = 10000.0

    def build(self, head_dim: int) -> RotaryEmbedding:
        return RotaryEmbedding(self, head_dim)


@dataclass
class NoPositionConfig(PositionConfig):
    def build(self, head_dim: int) -> NoPosition:
        return NoPosition()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer) in the "rotate half" layout that HF Llama uses.

    Angles are computed in float32 from the absolute positions on every call: no buffers, so the
    module is valid on the meta device and for any sequence length, and the values match HF's
    float32 computation bit for bit.
    """

    def __init__(self, config: RotaryEmbeddingConfig, head_dim: int):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.theta = config.theta
        self.head_dim = head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [B, Hq, S, D] and ``k`` [B, Hkv, S, D] by ``positions`` [B, S]."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=q.device).float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponents)
        angles = positions.float()[..., None] * inv_freq  # [B, S, D/2]
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, S, D]
        cos, sin = angles.cos(), angles.sin()
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated_half * sin.to(x.dtype)


class NoPosition(nn.Module):
    """No position information in attention (for models that add it elsewhere, or NoPE)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k
