"""Choosing the next token from logits: greedy, or temperature sampling with top-k / top-p."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from axtorch.config.errors import ConfigError


@dataclass
class SamplingConfig:
    #: 0 means greedy (argmax); otherwise logits are divided by it before sampling.
    temperature: float = 0.0
    #: Keep only the k most likely tokens (None: all).
    top_k: Optional[int] = None
    #: Keep the smallest set of tokens whose probability reaches p (None: all).
    top_p: Optional[float] = None

    def validate(self, key: str = "sampling") -> None:
        if self.temperature < 0:
            raise ConfigError(f"{key}.temperature", self.temperature, "0 (greedy) or a positive float")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"{key}.top_k", self.top_k, "a positive integer or null")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"{key}.top_p", self.top_p, "a probability in (0, 1] or null")


def sample_next_token(
    logits: torch.Tensor, config: SamplingConfig, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]."""
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / config.temperature
    if config.top_k is not None:
        kth = torch.topk(logits, min(config.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= config.top_p  # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probabilities = logits.softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)
