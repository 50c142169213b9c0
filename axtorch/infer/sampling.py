"""Choosing the next tokens of a batch from logits: greedy, or sampling shaped by temperature,
top-k, top-p, min-p and repetition / frequency / presence penalties.

Everything stays on the device: penalties read token counts kept there, and each row draws its
noise from its own generator, so a row's tokens depend on its seed and not on its batch mates.
"""

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
    #: Drop tokens less likely than ``min_p`` times the most likely one (None: none).
    min_p: Optional[float] = None
    #: Divide positive (multiply negative) logits of tokens seen in the prompt or output (1: off; HF's rule).
    repetition_penalty: float = 1.0
    #: Subtract this times the number of times a token was generated (0: off; OpenAI's rule).
    frequency_penalty: float = 0.0
    #: Subtract this once from every token generated at least once (0: off).
    presence_penalty: float = 0.0

    def validate(self, key: str = "sampling") -> None:
        if self.temperature < 0:
            raise ConfigError(f"{key}.temperature", self.temperature, "0 (greedy) or a positive float")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"{key}.top_k", self.top_k, "a positive integer or null")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"{key}.top_p", self.top_p, "a probability in (0, 1] or null")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"{key}.min_p", self.min_p, "a fraction in [0, 1] or null")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"{key}.repetition_penalty", self.repetition_penalty, "a positive float (1: off)")

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def apply_penalties(
    logits: torch.Tensor, config: SamplingConfig, seen: torch.Tensor, generated_counts: torch.Tensor
) -> torch.Tensor:
    """Penalised logits [B, V]: ``seen`` [B, V] marks prompt and output tokens, ``generated_counts`` the output's."""
    logits = logits.float()
    if config.repetition_penalty != 1.0:
        penalised = torch.where(logits > 0, logits / config.repetition_penalty, logits * config.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if config.frequency_penalty != 0.0:
        logits = logits - config.frequency_penalty * generated_counts
    if config.presence_penalty != 0.0:
        logits = logits - config.presence_penalty * (generated_counts > 0)
    return logits


def sample_next_token(
    logits: torch.Tensor, config: SamplingConfig, generators: Optional[list[torch.Generator]] = None
) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V] (already penalised).

    Sampling draws one exponential variate per token from row ``b``'s generator and takes
    ``argmax(p / E)``, which picks token ``i`` with probability ``p_i`` (the exponential race).
    """
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / config.temperature
    if config.top_k is not None:
        kth = torch.topk(logits, min(config.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        sorted_probabilities = sorted_logits.softmax(dim=-1)
        drop_sorted = (
            sorted_probabilities.cumsum(dim=-1) - sorted_probabilities >= config.top_p
        )  # keep the crossing one
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probabilities = logits.softmax(dim=-1)
    if config.min_p is not None:
        floor = config.min_p * probabilities.amax(dim=-1, keepdim=True)
        probabilities = probabilities.masked_fill(probabilities < floor, 0.0)
    if generators is None:
        noise = torch.empty_like(probabilities).exponential_()
    else:
        noise = torch.stack(
            [torch.empty_like(row).exponential_(generator=g) for row, g in zip(probabilities, generators)]
        )
    return (probabilities / noise).argmax(dim=-1)
