"""Attention kernels: how scores become outputs, ``softmax(mask(scale * q.k)) v``, as a child of attention.

The attention layer projects, encodes positions, builds the mask and hands q, k, v to the kernel
its config names (``model/attention_kernel=...``): ``sdpa`` (PyTorch's fused kernels, the
default) or ``softcapped`` (Gemma 2's ``cap * tanh(scores / cap)``, computed explicitly since SDPA
has no hook between q.k and the softmax). A decode kernel, flex attention or a CUDA flash
kernel is one more config and module here, not a branch inside the attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.softcap import softcap


@dataclass
class AttentionKernelConfig:
    """Slot type for an attention kernel; build with ``build()``."""

    def validate(self, key: str) -> None:
        pass

    def build(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete attention kernel config")


@dataclass
class SdpaKernelConfig(AttentionKernelConfig):
    """``torch.nn.functional.scaled_dot_product_attention``: flash / memory-efficient kernels where they apply."""

    def build(self) -> SdpaKernel:
        return SdpaKernel()


class SdpaKernel(nn.Module):
    #: Whether a plain causal mask may be left to the kernel (``causal=True``, no mask tensor).
    fuses_causal_mask = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: Optional[torch.Tensor],
        causal: bool,
        scale: Optional[float],
        dropout_p: float,
    ) -> torch.Tensor:
        """q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D] (Hkv divides Hq); ``mask`` boolean (True: allowed)
        or additive float, broadcastable to [B, Hq, Sq, Sk]; ``scale`` None means ``1/sqrt(D)``."""
        grouped = q.shape[1] != k.shape[1]
        if grouped and not sdpa_takes_grouped_heads(q, mask):
            k, v = repeated_heads(k, v, q.shape[1])
            grouped = False
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            dropout_p=dropout_p,
            scale=scale,
            enable_gqa=grouped,
        )


def sdpa_takes_grouped_heads(q: torch.Tensor, mask: Optional[torch.Tensor]) -> bool:
    """Whether SDPA may be given grouped-query k and v as they are (``enable_gqa``).

    On CUDA only flash attention (half precision, no mask tensor) and the O(S^2) math fallback take
    grouped heads: in fp32, or with a document mask, SDPA falls back to math and keeps every
    layer's [B, H, S, S] attention weights for the backward (llama3_1b, batch 4 x 2048 in fp32 on
    an H200: 77.9 GiB at the peak). With k and v repeated the memory-efficient kernel runs instead.
    The CPU's flash kernel takes grouped heads with a mask and in fp32.
    """
    return q.device.type != "cuda" or (mask is None and q.dtype in (torch.float16, torch.bfloat16))


def repeated_heads(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v [B, Hkv, S, D] with each head repeated for its group of query heads: [B, heads, S, D]."""
    groups = heads // k.shape[1]
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


@dataclass
class SoftcappedKernelConfig(AttentionKernelConfig):
    """Scores soft-capped to ``(-cap, cap)`` before the mask and softmax (Gemma 2 uses 50)."""

    cap: float = 50.0

    def validate(self, key: str) -> None:
        if not self.cap > 0:
            raise ConfigError(f"{key}.cap", self.cap, "a positive number")

    def build(self) -> SoftcappedKernel:
        return SoftcappedKernel(self.cap)


class SoftcappedKernel(nn.Module):
    """Computes the [B, H, Sq, Sk] scores explicitly (O(S^2) memory), in q's dtype with the
    softmax in float32, as HF's eager Gemma 2 attention does."""

    fuses_causal_mask = False

    def __init__(self, cap: float):
        super().__init__()
        self.cap = cap

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: Optional[torch.Tensor],
        causal: bool,
        scale: Optional[float],
        dropout_p: float,
    ) -> torch.Tensor:
        """As ``SdpaKernel``; ``causal`` is never set, since the kernel does not fuse the mask."""
        if mask is None or causal:
            raise ValueError("the soft-capped kernel needs its mask as a tensor")
        k, v = repeated_heads(k, v, q.shape[1])
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale
        scores = softcap(scores, self.cap)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(F.dropout(weights, p=dropout_p), v)

    def extra_repr(self) -> str:
        return f"cap={self.cap}"
