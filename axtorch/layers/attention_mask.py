"""Which keys a query may attend to. ``MaskConfig`` is the slot type of the attention mask.

Masks compare absolute positions, so the same rule serves training (keys are the sequence) and
KV-cache decoding (keys are cache slots indexed by position; empty slots lie in the future and
are masked by the same comparison).

Packed sequences add a part: segment ids (which document each token belongs to).
``DocumentMask`` composes the configured mask with "the same document" (AXLearn's
``and_masks`` of a causal or sliding-window mask and a segment mask). Positions restart at 0 in
every document, so causal and window comparisons stay right within one, and a token never sees
another document.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import MISSING
from torch import nn

from axtorch.layers.shared_values import SharedValues


@dataclass
class MaskConfig:
    """Slot type for an attention mask; build with ``build()``."""

    def build(self) -> AttentionMask:
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete mask config")


@dataclass
class CausalMaskConfig(MaskConfig):
    def build(self) -> CausalMask:
        return CausalMask()


@dataclass
class SlidingWindowMaskConfig(MaskConfig):
    """Causal attention to the last ``window`` positions only (Mistral, Gemma's local layers)."""

    #: How many positions a query sees, itself included.
    window: int = MISSING

    def build(self) -> SlidingWindowMask:
        return SlidingWindowMask(self)


def position_distance(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, Sq, Sk] how many positions each key lies behind each query (negative: in its future).

    Masks compare it with their window; position encodings that bias scores by distance (ALiBi)
    scale it.
    """
    return query_positions[:, None, :, None] - key_positions[:, None, None, :]


class AttentionMask(nn.Module):
    """What attention asks of a mask: called with query and key positions, a boolean [B, 1, Sq, Sk]."""

    #: How many positions back a query can see, itself included; None when unbounded. A KV cache
    #: for a bounded mask keeps only that many recent positions (a ring, see ``KVCache``).
    window: Optional[int] = None
    #: True when, for a full sequence with positions 0..S-1, the mask is plain causal, which lets
    #: attention use the fused ``is_causal`` kernels instead of materialising the mask.
    is_plain_causal: bool


class CausalMask(AttentionMask):
    """A query at position p sees keys at positions <= p."""

    is_plain_causal = True

    def forward(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Boolean [B, 1, Sq, Sk] mask, True where attention is allowed."""
        return position_distance(query_positions, key_positions) >= 0


class SlidingWindowMask(AttentionMask):
    """A query at position p sees keys at positions in (p - window, p]."""

    is_plain_causal = False

    def __init__(self, config: SlidingWindowMaskConfig):
        super().__init__()
        if config.window <= 0:
            raise ValueError(f"sliding-window mask needs a positive window, got window={config.window}")
        self.window: int = config.window

    def forward(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Boolean [B, 1, Sq, Sk] mask, True where attention is allowed."""
        distance = position_distance(query_positions, key_positions)
        return (distance >= 0) & (distance < self.window)

    def extra_repr(self) -> str:
        return f"window={self.window}"


def same_segment(query_segments: torch.Tensor, key_segments: torch.Tensor) -> torch.Tensor:
    """[B, 1, Sq, Sk] True where the query and the key belong to the same document (segment id)."""
    return query_segments[:, None, :, None] == key_segments[:, None, None, :]


class DocumentMask(AttentionMask):
    """The configured mask (``within``) and, when segment ids are given, the same document.

    Without segment ids (unpacked data, KV-cache decoding of one document) it is ``within``
    unchanged, so a plain causal mask keeps its fused kernel path.
    """

    def __init__(self, within: MaskConfig):
        super().__init__()
        self.within = within.build()
        self.window = self.within.window
        self.is_plain_causal = self.within.is_plain_causal
        #: What the configured mask computes from positions: its config's type and fields, so
        #: layers with equal masks share one under ``SharedValues`` whatever the mask's parameters.
        self.rule = (type(within), dataclasses.astuple(within))

    def forward(
        self,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        query_segments: Optional[torch.Tensor] = None,
        key_segments: Optional[torch.Tensor] = None,
        shared: Optional[SharedValues] = None,
    ) -> torch.Tensor:
        """Boolean [B, 1, Sq, Sk] mask, True where attention is allowed.

        With ``shared``, layers of the same mask over the same key positions (caches that share
        their slot positions) share one mask.
        """
        if shared is None:
            allowed = self.within(query_positions, key_positions)
        else:
            key = (self.rule, id(query_positions), id(key_positions))
            allowed = shared.get(key, lambda: self.within(query_positions, key_positions))
        if query_segments is None or key_segments is None:
            return allowed
        return allowed & same_segment(query_segments, key_segments)
