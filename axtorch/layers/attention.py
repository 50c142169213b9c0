"""Multi-head attention with grouped-query (and multi-query) key/value heads.

Behaviour comes from children named in the config: the projections (``LinearConfig``), the
optional per-head query and key norms (``NormConfig``), the position encoding
(``PositionConfig``), the mask (``MaskConfig``) and the kernel that turns scores into outputs
(``AttentionKernelConfig``: SDPA, soft-capped, ...). MHA, GQA and MQA are the same class:
``num_kv_heads`` equal to, a divisor of, or 1 against ``num_heads``. A position encoding's
score bias (ALiBi) joins the mask as an additive float mask, which every kernel takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, Protocol, runtime_checkable

import torch
from omegaconf import MISSING
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.attention_kernel import AttentionKernelConfig, SdpaKernelConfig
from axtorch.layers.attention_mask import DocumentMask, MaskConfig
from axtorch.layers.kv_cache import KVCache
from axtorch.layers.linear import LinearConfig
from axtorch.layers.norm import NormConfig
from axtorch.layers.relative_position import PositionConfig
from axtorch.layers.remat import ActivationWidths, activation_name
from axtorch.layers.seams import Seams
from axtorch.layers.shared_values import SharedValues


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
    #: Factor on q.k before the softmax; None means ``1 / sqrt(head_dim)``. Gemma sets
    #: ``query_pre_attn_scalar ** -0.5``, which differs from that when head_dim does.
    softmax_scale: Optional[float] = None
    #: How scores become outputs: SDPA's fused kernels, a soft-capped kernel (Gemma 2), ...;
    #: None means SDPA (``model/attention_kernel=`` chooses one on the command line).
    kernel: Optional[AttentionKernelConfig] = None

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
                f"{key}.num_heads",
                self.num_heads,
                f"a divisor of model.dim={dim}, e.g. {divisors[-6:]}",
                reason=f"{self.num_heads} heads do not divide model.dim={dim}",
            )
        kv_heads = self.resolved_kv_heads()
        if kv_heads <= 0 or self.num_heads % kv_heads:
            divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ConfigError(
                f"{key}.num_kv_heads",
                self.num_kv_heads,
                f"a divisor of num_heads={self.num_heads}: {divisors}",
                reason=f"{kv_heads} kv heads do not divide {self.num_heads} query heads",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{key}.dropout", self.dropout, "a probability in [0, 1)")
        if self.softmax_scale is not None and not self.softmax_scale > 0:
            raise ConfigError(
                f"{key}.softmax_scale", self.softmax_scale, "a positive number, or null for 1/sqrt(head_dim)"
            )
        if self.kernel is not None:
            self.kernel.validate(f"{key}.kernel")

    def _local_widths(self, dim: int, tensor_parallel: int) -> tuple[float, float]:
        """Query and key (or value) features per token on one rank of ``tensor_parallel``."""
        head_dim = self.resolved_head_dim(dim)
        return self.num_heads * head_dim / tensor_parallel, self.resolved_kv_heads() * head_dim / tensor_parallel

    def saved_width(self, dim: int, tensor_parallel: int = 1) -> float:
        """Values per token on one device that the backward keeps, without remat (``axtorch.plan.memory``).

        The rotated queries and keys, the values and the output that attention's kernel keeps, the
        output again as the output projection's input, one log-sum-exp per head (a fused kernel's
        O(s) state), the position encoding's tables and the query and key norms' own.
        """
        head_dim = self.resolved_head_dim(dim)
        query, key_value = self._local_widths(dim, tensor_parallel)
        width = 2 * query + 2 * key_value + self.num_heads / tensor_parallel + self.position.saved_width(head_dim)
        # A query or key norm's output is kept by the next op that needs it, counted above.
        for norm, normed in ((self.query_norm, query), (self.key_norm, key_value)):
            if norm is not None:
                width += norm.saved_width(normed) - normed
        return width

    def activation_widths(self, dim: int, tensor_parallel: int = 1) -> ActivationWidths:
        """The activations ``GroupedQueryAttention`` names for remat, in features per token on one device."""
        query, key_value = self._local_widths(dim, tensor_parallel)
        return {
            "attention_query": query,
            "attention_key": key_value,
            "attention_value": key_value,
            "attention_context": query,
            "attention_output": dim,
        }

    def build(self, dim: int) -> GroupedQueryAttention:
        return GroupedQueryAttention(self, dim)


@runtime_checkable
class SequenceExchange(Protocol):
    """The keys and values that this process's queries attend to, with the keys' positions and
    documents (segment ids; None when the rows are not packed documents).

    When the sequence is split over processes (context parallelism), a backend fills this seam
    with one that gathers the other processes' keys and values with their positions and
    documents, which the mask then compares. The default, ``local_sequence``, keeps this process's own.
    """

    def __call__(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, segment_ids: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]: ...


def local_sequence(
    keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, segment_ids: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The default ``SequenceExchange``: the whole sequence is here.

    The key positions are the queries' very tensor, which tells ``forward`` that a fusing kernel
    may apply a plain causal mask itself.
    """
    return keys, values, positions, segment_ids


@runtime_checkable
class QKVProjection(Protocol):
    """The queries, keys and values, each [B, S, heads * head_dim], of ``attention``'s input ``x``.

    The default, ``project_separately``, runs the three projections. Decoding on a CPU fills this
    seam with one product by the three weights stacked (``axtorch.infer.cpu_weights``): one
    longer read of memory and one call instead of three, the same values.
    """

    def __call__(
        self, attention: GroupedQueryAttention, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def project_separately(
    attention: GroupedQueryAttention, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The default ``QKVProjection``: ``q_proj``, ``k_proj`` and ``v_proj``, each under its remat name."""
    with activation_name("attention_query"):
        q = attention.q_proj(x)
    with activation_name("attention_key"):
        k = attention.k_proj(x)
    with activation_name("attention_value"):
        v = attention.v_proj(x)
    return q, k, v


@dataclass
class AttentionInput:
    hidden_states: torch.Tensor  # [B, S, dim]
    positions: torch.Tensor  # [B, S] absolute positions
    kv_cache: Optional[KVCache] = None
    #: [B, S] document of each token of packed sequences (positions restart in each); None: one
    #: document per row. Attention then stays within a document (``DocumentMask``).
    segment_ids: Optional[torch.Tensor] = None
    #: Tables every layer of this forward computes alike (rotary cos/sin, the mask), or None.
    shared: Optional[SharedValues] = None


@dataclass
class AttentionOutput:
    hidden_states: torch.Tensor  # [B, S, dim]
    kv_cache: Optional[KVCache] = None


class GroupedQueryAttention(nn.Module):
    #: What a backend may replace (``axtorch.layers.seams``).
    SEAMS: ClassVar[Seams] = {"sequence_exchange": SequenceExchange, "qkv_projection": QKVProjection}

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
        self.mask = DocumentMask(config.mask)
        self.kernel = (config.kernel or SdpaKernelConfig()).build()
        self.sequence_exchange: SequenceExchange = local_sequence
        self.qkv_projection: QKVProjection = project_separately

    def allocate_kv_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_write: Optional[int] = None,
    ) -> KVCache:
        """A full cache, or a ring of the mask's window when ``max_write`` bounds the tokens per call."""
        return KVCache.allocate(
            batch_size,
            self.num_kv_heads,
            max_len,
            self.head_dim,
            dtype=dtype,
            device=device,
            window=self.mask.window,
            max_write=max_write,
        )

    def forward(self, inputs: AttentionInput) -> AttentionOutput:
        x = inputs.hidden_states
        batch, seq, _ = x.shape
        # Head counts come from the projections' outputs, so a tensor-parallel backend that splits
        # the projections by heads runs this code unchanged on its local heads.
        q, k, v = self.qkv_projection(self, x)
        q, k = q.view(batch, seq, -1, self.head_dim), k.view(batch, seq, -1, self.head_dim)
        if self.query_norm is not None:
            with activation_name("attention_query"):
                q = self.query_norm(q)
        if self.key_norm is not None:
            with activation_name("attention_key"):
                k = self.key_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = self.position(q, k, inputs.positions, inputs.shared)

        segments = inputs.segment_ids
        if inputs.kv_cache is not None:
            if segments is not None:
                raise ValueError("KV-cache decoding reads one document per row: pass no segment ids")
            k, v = inputs.kv_cache.update(k, v, inputs.positions)
            key_positions, key_segments = inputs.kv_cache.key_positions(), None
        else:
            k, v, key_positions, key_segments = self.sequence_exchange(k, v, inputs.positions, segments)
        bias = self.position.score_bias(inputs.positions, key_positions, self.num_heads)
        if bias is not None and bias.shape[1] != q.shape[1]:
            raise ValueError(
                f"the position encoding biases {bias.shape[1]} heads but this attention holds {q.shape[1]}: "
                "an encoding that differs between heads cannot run on a tensor-parallel subset of them"
            )
        # A plain causal mask over a whole sequence lets a fusing kernel apply it itself.
        fused_causal = (
            key_positions is inputs.positions
            and self.mask.is_plain_causal
            and bias is None
            and self.kernel.fuses_causal_mask
            and segments is None
        )
        mask: Optional[torch.Tensor] = None
        if not fused_causal:
            allowed = self.mask(inputs.positions, key_positions, segments, key_segments, inputs.shared)
            # With a bias, an additive float mask: the bias where allowed, -inf elsewhere.
            mask = allowed if bias is None else bias.to(q.dtype).masked_fill(~allowed, float("-inf"))
        with activation_name("attention_context"):
            out = self.kernel(
                q,
                k,
                v,
                mask=mask,
                causal=fused_causal,
                scale=self.config.softmax_scale,
                dropout_p=self.config.dropout if self.training else 0.0,
            )
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        with activation_name("attention_output"):
            return AttentionOutput(hidden_states=self.o_proj(out), kv_cache=inputs.kv_cache)


def _build_optional_norm(config: Optional[NormConfig], dim: int) -> Optional[nn.Module]:
    return None if config is None else config.build(dim)
