"""Position-wise feed-forward blocks. ``FeedForwardConfig`` is the slot type of a layer's FFN.

``GatedFeedForward`` is SwiGLU with ``activation=silu`` (Llama, Mistral, Qwen) and GeGLU with
``gelu``; ``MLPFeedForward`` is the classic two-matrix MLP (GPT-2).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from omegaconf import MISSING
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.linear import LinearConfig
from axtorch.layers.remat import ActivationWidths, activation_name
from axtorch.layers.seams import Seams


class Activation(enum.Enum):
    silu = "silu"
    gelu = "gelu"
    gelu_tanh = "gelu_tanh"
    relu = "relu"


def activate(x: torch.Tensor, activation: Activation) -> torch.Tensor:
    if activation is Activation.silu:
        return F.silu(x)
    if activation is Activation.gelu:
        return F.gelu(x)
    if activation is Activation.gelu_tanh:
        return F.gelu(x, approximate="tanh")
    return F.relu(x)


@dataclass
class FeedForwardInput:
    hidden_states: torch.Tensor  # [B, S, dim]


@dataclass
class FeedForwardOutput:
    hidden_states: torch.Tensor  # [B, S, dim]
    #: Auxiliary loss the block wants added to the training objective (e.g. MoE load balancing).
    aux_loss: Optional[torch.Tensor] = None


@dataclass
class FeedForwardConfig:
    """Slot type for a feed-forward block; concrete configs build with ``build(dim)``."""

    #: Whether a token's output depends on the other tokens of the call (a router's capacity or
    #: load-balancing loss), so that running on a slice of each sequence would change it.
    mixes_tokens: ClassVar[bool] = False

    hidden_dim: int = MISSING
    activation: Activation = Activation.silu
    projection: LinearConfig = field(default_factory=LinearConfig)
    output_projection: LinearConfig = field(default_factory=LinearConfig)

    def validate(self, key: str) -> None:
        if self.hidden_dim <= 0:
            raise ConfigError(f"{key}.hidden_dim", self.hidden_dim, "a positive integer")

    def activation_widths(self, dim: int, tensor_parallel: int = 1) -> ActivationWidths:
        """The activations the block names for remat, in features per token on one device.

        A dense block's (``GatedFeedForward``, ``MLPFeedForward``); a block that names others says so.
        """
        return {"feed_forward_hidden": self.hidden_dim / tensor_parallel, "feed_forward_output": dim}

    def saved_width(self, dim: int, tensor_parallel: int = 1) -> float:
        """Values per token on one device that the backward keeps, without remat (``axtorch.plan.memory``)."""
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete feed-forward config")

    def expert_parallel_held(self, dim: int, expert: int) -> tuple[float, int]:
        """Under expert parallelism over ``expert`` processes, what it holds beyond ``saved_width``:
        values per token kept for the backward, and weight elements gathered whole while this
        layer runs. None for a dense block."""
        return 0.0, 0

    def build(self, dim: int) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete feed-forward config")


@dataclass
class GatedFeedForwardConfig(FeedForwardConfig):
    def saved_width(self, dim: int, tensor_parallel: int = 1) -> float:
        return 4 * self.hidden_dim / tensor_parallel  # the gate, the up projection, the activated gate, their product

    def build(self, dim: int) -> GatedFeedForward:
        return GatedFeedForward(self, dim)


@dataclass
class MLPFeedForwardConfig(FeedForwardConfig):
    activation: Activation = Activation.gelu

    def saved_width(self, dim: int, tensor_parallel: int = 1) -> float:
        return 2 * self.hidden_dim / tensor_parallel  # the hidden projection and its activation

    def build(self, dim: int) -> MLPFeedForward:
        return MLPFeedForward(self, dim)


@runtime_checkable
class GateUpProjection(Protocol):
    """The gate and up projections, each [B, S, hidden_dim], of ``feed_forward``'s input ``x``.

    The default, ``project_gate_up``, runs the two projections. Decoding on a CPU fills this seam
    with one product by the two weights stacked (``axtorch.infer.cpu_weights``), the same values.
    """

    def __call__(self, feed_forward: GatedFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def project_gate_up(feed_forward: GatedFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The default ``GateUpProjection``: ``gate_proj`` and ``up_proj``."""
    return feed_forward.gate_proj(x), feed_forward.up_proj(x)


class GatedFeedForward(nn.Module):
    """``down(act(gate(x)) * up(x))``."""

    #: What a backend or a decoder may replace (``axtorch.layers.seams``).
    SEAMS: ClassVar[Seams] = {"gate_up_projection": GateUpProjection}

    def __init__(self, config: GatedFeedForwardConfig, dim: int):
        super().__init__()
        self.activation = config.activation
        self.gate_proj = config.projection.build(dim, config.hidden_dim)
        self.up_proj = config.projection.build(dim, config.hidden_dim)
        self.down_proj = config.output_projection.build(config.hidden_dim, dim)
        self.gate_up_projection: GateUpProjection = project_gate_up

    def forward(self, inputs: FeedForwardInput) -> FeedForwardOutput:
        x = inputs.hidden_states
        with activation_name("feed_forward_hidden"):
            gate, up = self.gate_up_projection(self, x)
            h = activate(gate, self.activation) * up
        with activation_name("feed_forward_output"):
            return FeedForwardOutput(hidden_states=self.down_proj(h))


class MLPFeedForward(nn.Module):
    """``down(act(up(x)))``."""

    def __init__(self, config: MLPFeedForwardConfig, dim: int):
        super().__init__()
        self.activation = config.activation
        self.up_proj = config.projection.build(dim, config.hidden_dim)
        self.down_proj = config.output_projection.build(config.hidden_dim, dim)

    def forward(self, inputs: FeedForwardInput) -> FeedForwardOutput:
        with activation_name("feed_forward_hidden"):
            h = activate(self.up_proj(inputs.hidden_states), self.activation)
        with activation_name("feed_forward_output"):
            return FeedForwardOutput(hidden_states=self.down_proj(h))
