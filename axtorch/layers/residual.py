"""How each sublayer of a transformer layer joins the residual stream: where its norms sit.

``ResidualConfig`` is the slot type of ``TransformerLayerConfig.residual``, the norm placement.
For a sublayer ``f`` (attention or feed-forward) with norm ``norm``:

* pre-norm       ``x + dropout(f(norm(x)))``             (GPT-2, Llama)
* post-norm      ``norm(x + dropout(f(x)))``             (the original Transformer, BERT)
* sandwich-norm  ``x + dropout(post_norm(f(norm(x))))``  (CogView, Gemma 2)

The sublayer's ``norm`` belongs to the transformer layer, which passes it in: parameter names
then do not depend on the placement, and pre-norm's stay ``attention_norm`` and
``feed_forward_norm``, the names HF interop, the sharding presets and saved checkpoints use. A
placement owns only the norms it adds (the sandwich's ``post_norm``), built from the layer's norm
config. The dropout (GPT-2's ``resid_pdrop``) acts on the sublayer's output just before the add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Optional, Protocol, TypeVar

import torch
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.norm import NormConfig


class SublayerOutput(Protocol):
    hidden_states: torch.Tensor  # [B, S, dim]


#: A sublayer's output dataclass (``AttentionOutput``, ``FeedForwardOutput``), handed back whole
#: so that the layer can read its other fields (KV cache, auxiliary loss).
Output = TypeVar("Output", bound=SublayerOutput)
Sublayer = Callable[[torch.Tensor], Output]


@dataclass
class ResidualConfig:
    """Slot type for the norm placement; build one per sublayer with ``build(norm, dim)``."""

    #: Dropout on each sublayer's output before it is added to the residual stream.
    dropout: float = 0.0

    def validate(self, key: str) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{key}.dropout", self.dropout, "a probability in [0, 1)")

    #: Norms each sublayer runs: one before or after it, or one on each side (sandwich).
    norms_per_sublayer: ClassVar[int] = 1

    def build(self, norm: NormConfig, dim: int) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete norm placement")


@dataclass
class PreNormResidualConfig(ResidualConfig):
    def build(self, norm: NormConfig, dim: int) -> PreNormResidual:
        return PreNormResidual(self)


@dataclass
class PostNormResidualConfig(ResidualConfig):
    def build(self, norm: NormConfig, dim: int) -> PostNormResidual:
        return PostNormResidual(self)


@dataclass
class SandwichNormResidualConfig(ResidualConfig):
    norms_per_sublayer: ClassVar[int] = 2

    def build(self, norm: NormConfig, dim: int) -> SandwichNormResidual:
        return SandwichNormResidual(self, norm, dim)


def resolved_residual(config: Optional[ResidualConfig]) -> ResidualConfig:
    """``config``, or pre-norm without dropout when it is None.

    None is the layer config's default so that configs written in code (HF imports, tests) need
    not name a placement, while a Hydra choice can fill the slot with any of them.
    """
    return config if config is not None else PreNormResidualConfig()


def build_residual(config: Optional[ResidualConfig], norm: NormConfig, dim: int) -> nn.Module:
    """``config``'s module for one sublayer (``resolved_residual``)."""
    return resolved_residual(config).build(norm, dim)


class PreNormResidual(nn.Module):
    """``x + dropout(f(norm(x)))``: the stream itself is never normalised, which keeps deep stacks stable."""

    def __init__(self, config: PreNormResidualConfig):
        super().__init__()
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, norm: nn.Module, sublayer: Sublayer[Output]) -> tuple[torch.Tensor, Output]:
        out = sublayer(norm(x))
        return x + _dropped(self.dropout, out.hidden_states), out


class PostNormResidual(nn.Module):
    """``norm(x + dropout(f(x)))``: the stream is normalised after every sublayer."""

    def __init__(self, config: PostNormResidualConfig):
        super().__init__()
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, norm: nn.Module, sublayer: Sublayer[Output]) -> tuple[torch.Tensor, Output]:
        out = sublayer(x)
        return norm(x + _dropped(self.dropout, out.hidden_states)), out


class SandwichNormResidual(nn.Module):
    """``x + dropout(post_norm(f(norm(x))))``: pre-norm whose sublayer output is normalised too.

    ``post_norm`` bounds what each sublayer adds to the stream, which pre-norm alone lets grow.
    """

    def __init__(self, config: SandwichNormResidualConfig, norm: NormConfig, dim: int):
        super().__init__()
        self.post_norm = norm.build(dim)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, norm: nn.Module, sublayer: Sublayer[Output]) -> tuple[torch.Tensor, Output]:
        out = sublayer(norm(x))
        return x + _dropped(self.dropout, self.post_norm(out.hidden_states)), out


def _dropped(dropout: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """``dropout(x)``, skipping the module call where it is the identity (evaluation, or p = 0):
    decoding joins two sublayers a layer to the stream at every token."""
    return dropout(x) if dropout.training and dropout.p > 0 else x
