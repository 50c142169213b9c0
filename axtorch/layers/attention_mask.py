"""Which keys a query may attend to. ``MaskConfig`` is the slot type of the attention mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class MaskConfig:
    """Slot type for an attention mask; build with ``build()``."""

    def build(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete mask config")


@dataclass
class CausalMaskConfig(MaskConfig):
    def build(self) -> CausalMask:
        return CausalMask()


class CausalMask(nn.Module):
    """A query at position p sees keys at positions <= p.

    Masks compare absolute positions, so the same rule serves training (keys are the sequence)
    and KV-cache decoding (keys are cache slots indexed by position; empty slots lie in the
    future and are masked by the same comparison).
    """

    #: True when, for a full sequence with positions 0..S-1, the mask is plain causal, which lets
    #: attention use the fused ``is_causal`` kernels instead of materialising the mask.
    is_plain_causal = True

    def forward(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Boolean [B, 1, Sq, Sk] mask, True where attention is allowed."""
        return (key_positions[:, None, None, :] <= query_positions[:, None, :, None])
