"""Multi-head attention with grouped-query (and multi-query) key/value heads.

Behaviour comes from children named in the config: the projections (``LinearConfig``), the
optional per-head query and key norms (``NormConfig``), the position encoding
(``PositionConfig``) and the mask (``MaskConfig``). MHA, GQA and MQA are the
same class: ``num_kv_heads`` equal to, a divisor of, or 1 against ``num_heads``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from omegaconf import MISSING
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.attention_mask import MaskConfig
from axtorch.layers.kv_cache import KVCache
from axtorch.layers.linear import LinearConfig
from axtorch.layers.norm import NormConfig
from axtorch.layers.position import PositionConfig


@dataclass
class AttentionConfig:
    num_heads: int = MISSING
    #: None means as many as ``num_heads`` (plain multi-head attention).
    num_kv_heads: Optional[int] = None
    #: None means ``dim // num_heads``.
    head_dim: Optional[int] = None
    dropout: float = 0.0
    qkv_projection: LinearConfig = field(default_factory=LinearConfig)
    output_projection: LinearConfig = field(default_factory=LinearConfig)
    #: Norms over each head's ``head_dim`` features of the queries and keys, before the position
    #: encoding (QK-norm, as in Qwen3 and OLMo 2); None means none.
    query_norm: Optional[NormConfig] = None
    key_norm: Optional[NormConfig] = None
    position: PositionConfig = MISSING
    mask: MaskConfig = MISSING

    def resolved_kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def resolved_head_dim(self, dim: int) -> int:
        return dim // self.num_heads if self.head_dim is None else self.head_dim

    def validate(self, dim: int, key: str) -> None:
        """Raise ``ConfigError`` for head counts that cannot tile the model width."""
        if self.num_heads <= 0:
            raise ConfigError(f"{key}.num_heads", self.num_heads, "a positive integer")
        if self.head_dim is None and dim % self.num_heads:
            divisors = [d for d in range(1, min(dim, 128) + 1) if dim % d == 0]
            raise ConfigError(
                f"{key}.num_heads", self.num_heads, f"a divisor of model.dim={dim}, e.g. {divisors[-6:]}",
                reason=f"{self.num_heads} heads do not divide model.dim={dim}",
            )
        kv_heads = self.resolved_kv_heads()
        if kv_heads <= 0 or self.num_heads % kv_heads:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ConfigError(
                f"{key}.num_kv_heads", self.num_kv_heads, f"a divisor of num_heads={self.num_heads}: {divisors}",
                reason=f"{kv_heads} kv heads do not divide {self.num_heads} query heads",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{key}.dropout", self.dropout, "a probability in [0, 1)")

    def build(self, dim: int) -> GroupedQueryAttention:
        return GroupedQueryAttention(self, dim)


@dataclass
class AttentionInput:
    hidden_states: torch.Tensor  # [B, S, dim]
    positions: torch.Tensor  # [B, S] absolute positions
    kv_cache: Optional[KVCache] = None


@dataclass
class AttentionOutput:
    hidden_states: torch.Tensor  # [B, S, dim]
    kv_cache: Optional[KVCache] = None


class GroupedQueryAttention(nn.Module):
    def __init__(self, config: AttentionConfig, dim: int):
        super().__init__()
        self.config = config
        self.num_heads = config.num_heads
        self.num_kv_heads = config.resolved_kv_heads()
        self.head_dim = config.resolved_head_dim(dim)
        self.q_proj = config.qkv_projection.build(dim, self.num_heads * self.head_dim)
        self.k_proj = config.qkv_projection.build(dim, self.num_kv_heads * self.head_dim)
        self.v_proj = config.qkv_projection.build(dim, self.num_kv_heads * self.head_dim)
        self.o_proj = config.output_projection.build(self.num_heads * self.head_dim, dim)
        self.query_norm = _build_optional_norm(config.query_norm, self.head_dim)
        self.key_norm = _build_optional_norm(config.key_norm, self.head_dim)
        self.position = config.position.build(self.head_dim)
        self.mask = config.mask.build()

    def allocate_kv_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache.allocate(batch_size, self.num_kv_heads, max_len, self.head_dim, dtype=dtype, device=device)

    def forward(self, inputs: AttentionInput) -> AttentionOutput:
        x = inputs.hidden_states
        batch, seq, _ = x.shape
        # Head counts come from the projections' outputs, so a tensor-parallel backend that splits
        # the projections by heads runs this code unchanged on its local heads.
        q = self.query_norm(self.q_proj(x).view(batch, seq, -1, self.head_dim)).transpose(1, 2)
        k = self.key_norm(self.k_proj(x).view(batch, seq, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = self.position(q, k, inputs.positions)

        if inputs.kv_cache is not None:
            k, v = inputs.kv_cache.update(k, v, inputs.positions)
            mask = self.mask(inputs.positions, inputs.kv_cache.key_positions())
            is_causal = False
        elif self.mask.is_plain_causal:
            mask, is_causal = None, True
        else:
            mask, is_causal = self.mask(inputs.positions, inputs.positions), False

        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            is_causal=is_causal,
            dropout_p=self.config.dropout if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return AttentionOutput(hidden_states=self.o_proj(out), kv_cache=inputs.kv_cache)


def _build_optional_norm(config: Optional[NormConfig], dim: int) -> nn.Module:
    return nn.Identity() if config is None else config.build(dim)
