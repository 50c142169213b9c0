"""Absolute position embeddings: one vector per position, added to the token embeddings.

``PositionEmbeddingConfig`` is the slot type of ``CausalLMConfig.position_embedding``. It is a
different slot from ``axtorch.layers.relative_position``: those encodings act on queries and keys inside
every attention layer (RoPE), these enter once, at the bottom of the stack (GPT-2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from axtorch.layers.init import InitConfig, initialize


@dataclass
class PositionEmbeddingConfig:
    """Slot type for an absolute position embedding; build with ``build(max_seq_len, dim)``."""

    def build(self, max_seq_len: int, dim: int) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete position embedding config")


@dataclass
class LearnedPositionEmbeddingConfig(PositionEmbeddingConfig):
    """A trained table with one row per position below ``max_seq_len`` (GPT-2's ``wpe``)."""

    init: InitConfig = field(default_factory=InitConfig)

    def build(self, max_seq_len: int, dim: int) -> LearnedPositionEmbedding:
        return LearnedPositionEmbedding(self, max_seq_len, dim)


class LearnedPositionEmbedding(nn.Module):
    """Maps absolute positions [B, S] to vectors [B, S, dim]; ``weight`` is [max_seq_len, dim].

    The table has no row past ``max_seq_len - 1``, so unlike RoPE it cannot run longer sequences
    than it was built for. Positions are checked against the table when they are on the host,
    where reading their range costs no device synchronisation; on an accelerator a position out of
    range fails in the lookup itself.
    """

    def __init__(self, config: LearnedPositionEmbeddingConfig, max_seq_len: int, dim: int):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(max_seq_len, dim))

    def reset_parameters(self) -> None:
        initialize(self.weight, self.config.init)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        # A plain tensor: a fake one (as the dry run traces) has no values to read.
        if type(positions) is torch.Tensor and positions.device.type == "cpu" and positions.numel():
            low, high = (int(bound) for bound in torch.aminmax(positions))
            if low < 0 or high >= rows:
                raise ValueError(
                    f"positions {low}..{high} fall outside the learned position table, which covers 0..{rows - 1} "
                    f"(model.max_seq_len={rows})"
                )
        return F.embedding(positions, self.weight)
