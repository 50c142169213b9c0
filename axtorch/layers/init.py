"""Parameter initialisation as configuration: every parameterised layer names its scheme here."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class InitScheme(enum.Enum):
    normal = "normal"
    truncated_normal = "truncated_normal"
    zeros = "zeros"
    ones = "ones"


@dataclass
class InitConfig:
    """How one parameter is initialised.

    ``truncated_normal`` cuts at +-2 std (the convention of Llama and AXLearn). Randomness
    comes from torch's global generator, so a seeded run initialises identically.
    """

    scheme: InitScheme = InitScheme.normal
    std: float = 0.02


@torch.no_grad()
def initialize(tensor: torch.Tensor, config: InitConfig) -> None:
    """Fill ``tensor`` in place according to ``config``."""
    if config.scheme is InitScheme.normal:
        tensor.normal_(0.0, config.std)
    elif config.scheme is InitScheme.truncated_normal:
        torch.nn.init.trunc_normal_(tensor, 0.0, config.std, -2 * config.std, 2 * config.std)
    elif config.scheme is InitScheme.zeros:
        tensor.zero_()
    elif config.scheme is InitScheme.ones:
        tensor.fill_(1.0)
    else:  # pragma: no cover - the enum is exhaustive
        raise ValueError(f"unknown init scheme {config.scheme}")

