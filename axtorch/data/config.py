"""The ``data`` section of a run config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from axtorch.config.errors import ConfigError
from axtorch.data.mixture import MixtureEntryConfig
from axtorch.data.sources import SourceConfig
from axtorch.data.tokenizer import TokenizerConfig


@dataclass
class DataConfig:
    """Which corpus, how it is tokenized, and how it is cut into training sequences.

    ``seed`` picks both the validation documents and the per-epoch shuffle (and a mixture's
    draws); ``cache_dir`` holds the tokenizer and token arrays, keyed by corpus and settings, so
    later runs skip tokenization. ``source`` and ``mixture`` are alternatives: one source, or a
    weighted mixture of streaming sources. ``streams`` is the number of virtual streams a
    streaming corpus is read as: fixed for a run, so that its batches do not depend on how many
    data-parallel ranks read them (it must be a multiple of that number and divide the batch size;
    null, the default, is one per row of the global batch, which fits any number of ranks).
    ``document_masking`` keeps each packed document to itself: a token attends only within its
    document, positions restart at 0 in each, and no loss crosses a boundary (``data=chat``'s default).
    """

    source: Optional[SourceConfig] = None
    mixture: Optional[list[MixtureEntryConfig]] = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    seq_len: int = 256
    val_fraction: float = 0.02
    seed: int = 0
    cache_dir: str = "~/.cache/axtorch/data"
    streams: Optional[int] = None
    document_masking: bool = False

    def validate(self) -> None:
        """The checks that need no file: which corpus, and the numbers that cut it."""
        if self.source is not None and self.mixture is not None:
            raise ConfigError(
                "data.mixture", "(set)", "data.source or data.mixture, not both", reason="data.source is also set"
            )
        if self.source is None and self.mixture is None:
            raise ConfigError("data.source", None, "a source (data=jsonl, data=text_files, ...) or data.mixture")
        if self.source is not None and not isinstance(self.source, SourceConfig):
            raise ConfigError(
                "data.source", self.source, "a SourceConfig subclass instance, e.g. PythonStdlibSourceConfig()"
            )
        if self.seq_len < 1:
            raise ConfigError("data.seq_len", self.seq_len, "an integer >= 1")
        if not 0.0 <= self.val_fraction < 0.5:
            raise ConfigError("data.val_fraction", self.val_fraction, "a number in [0, 0.5)")
        if self.streams is not None and self.streams < 1:
            raise ConfigError("data.streams", self.streams, "null (one per row of the batch) or an integer >= 1")
