"""The ``data`` section of a run config."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from axtorch.data.sources import SourceConfig
from axtorch.data.tokenizer import TokenizerConfig


@dataclass
class DataConfig:
    """Which corpus, how it is tokenized, and how it is cut into training sequences.

    ``seed`` picks both the validation documents and the per-epoch shuffle; ``cache_dir`` holds
    the tokenizer and token arrays, keyed by corpus and settings, so later runs skip tokenization.
    """

    source: SourceConfig = MISSING
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    seq_len: int = 256
    val_fraction: float = 0.02
    seed: int = 0
    cache_dir: str = "~/.cache/axtorch/data"
