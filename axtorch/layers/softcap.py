"""Soft-capping, ``cap * tanh(x / cap)``: values bounded to ``(-cap, cap)`` smoothly, near-identity
well inside the cap. Gemma 2 caps attention scores (in ``attention_kernel``) and final logits
(``CausalLMConfig.logit_softcap``) with it, which keeps either from growing without bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import MISSING
from torch import nn

from axtorch.config.errors import ConfigError


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``, in ``x``'s dtype."""
    return cap * torch.tanh(x / cap)


@dataclass
class SoftCapConfig:
    #: The bound: outputs lie in ``(-cap, cap)`` (Gemma 2's final logits use 30).
    cap: float = MISSING

    def validate(self, key: str) -> None:
        if not self.cap > 0:
            raise ConfigError(f"{key}.cap", self.cap, "a positive number")

    def build(self) -> SoftCap:
        return SoftCap(self)


class SoftCap(nn.Module):
    def __init__(self, config: SoftCapConfig):
        super().__init__()
        self.cap = config.cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softcap(x, self.cap)

    def extra_repr(self) -> str:
        return f"cap={self.cap}"
