"""Token embedding table; also serves as the output head when embeddings are tied."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from axtorch.layers.init import InitConfig, initialize


@dataclass
class EmbeddingConfig:
    init: InitConfig = field(default_factory=InitConfig)

    def build(self, vocab_size: int, dim: int) -> Embedding:
        return Embedding(self, vocab_size, dim)


class Embedding(nn.Module):
    """Maps token ids [B, S] to vectors [B, S, dim]; ``weight`` is [vocab_size, dim]."""

    def __init__(self, config: EmbeddingConfig, vocab_size: int, dim: int):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))

    def reset_parameters(self) -> None:
        initialize(self.weight, self.config.init)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def attend(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Project hidden states onto the vocabulary with the same table (tied output head)."""
        return F.linear(hidden_states, self.weight)
