"""Token embedding table; also serves as the output head when embeddings are tied."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.init import InitConfig, initialize


@dataclass
class EmbeddingConfig:
    init: InitConfig = field(default_factory=InitConfig)
    #: Constant factor on the looked-up vectors (e.g. Granite's ``embedding_multiplier``).
    multiplier: float = 1.0
    #: Multiply by ``sqrt(dim)`` too (Gemma, and the original Transformer): a table initialised
    #: small, or shared with the output head, then feeds the first layer at about unit scale.
    scale_by_sqrt_dim: bool = False

    def validate(self, key: str) -> None:
        if not self.multiplier > 0:
            raise ConfigError(f"{key}.multiplier", self.multiplier, "a positive float")

    def build(self, vocab_size: int, dim: int) -> Embedding:
        return Embedding(self, vocab_size, dim)


#: The floating dtypes whose rounded scale is kept; a lookup in any other dtype is scaled by the
#: unrounded factor.
_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Embedding(nn.Module):
    """Maps token ids [B, S] to vectors [B, S, dim]; ``weight`` is [vocab_size, dim].

    The lookup is multiplied by the config's scale; ``attend`` (the tied output head) uses the
    table unscaled, as Gemma does.
    """

    def __init__(self, config: EmbeddingConfig, vocab_size: int, dim: int):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.scale = config.multiplier * (math.sqrt(dim) if config.scale_by_sqrt_dim else 1.0)
        # The factor rounded to each activation dtype first, as Gemma does, so that a bf16 model
        # scales by exactly what HF's does; rounded here once, not in the forward, where reading
        # a tensor back (``item``) would split a compiled graph.
        self.scale_in = {
            dtype: torch.tensor(self.scale, dtype=dtype, device="cpu").item() for dtype in _ACTIVATION_DTYPES
        }

    def reset_parameters(self) -> None:
        initialize(self.weight, self.config.init)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        vectors = F.embedding(ids, self.weight)
        if self.scale == 1.0:
            return vectors
        return vectors * self.scale_in.get(vectors.dtype, self.scale)

    def attend(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Project hidden states onto the vocabulary with the same table (tied output head)."""
        return F.linear(hidden_states, self.weight)
