"""Weighted mixtures of streaming sources: which source feeds each row of each global batch.

The choice for row ``j`` of step ``t`` is a pure function of ``(seed, t, j)`` (a counter-based
draw), so it is the same on any number of ranks and after any resume, and needs no state of its
own; each source keeps its own position per virtual stream (``axtorch.data.streaming``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from omegaconf import MISSING

from axtorch.config.errors import ConfigError
from axtorch.data.files import stable_hash
from axtorch.data.sources import DocumentSource, PartitionedSource, SourceConfig


@dataclass
class MixtureEntryConfig:
    """One source of ``data.mixture`` and its weight (weights are relative: they need not sum to 1).

    ``source`` is a source config (``JsonlSourceConfig(...)``), or on the command line a mapping
    naming a ``data/source`` option: ``{kind: jsonl, paths: [...]}``. A mixture always streams.
    """

    source: Any = MISSING
    weight: float = 1.0


def mixture_sources(entries: list[MixtureEntryConfig]) -> list[tuple[PartitionedSource, float]]:
    """Each entry's source, built to stream, with its weight as a share of the total."""
    if not entries:
        raise ConfigError("data.mixture", entries, "null, or a non-empty list of {source, weight}")
    built = []
    for index, entry in enumerate(entries):
        key = f"data.mixture[{index}]"
        if not entry.weight > 0:
            raise ConfigError(f"{key}.weight", entry.weight, "a number > 0")
        source = entry.source
        streams = isinstance(source, SourceConfig) and any(f.name == "streaming" for f in dataclasses.fields(source))
        if not streams:
            raise ConfigError(
                f"{key}.source", type(source).__name__, "a source that can stream: jsonl, parquet or hf_dataset"
            )
        streaming = dataclasses.replace(source, streaming=True).build_streaming()
        assert streaming is not None  # streaming=True
        built.append((streaming, float(entry.weight)))
    total = sum(weight for _, weight in built)
    return [(source, weight / total) for source, weight in built]


def row_sources(seed: int, step: int, rows: int, shares: list[float]) -> np.ndarray:
    """Which source (an index into ``shares``) feeds each of the ``rows`` rows of global batch ``step``."""
    if len(shares) == 1:
        return np.zeros(rows, dtype=np.int64)
    uniform = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, step]))).random(rows)
    return np.minimum(np.searchsorted(np.cumsum(shares), uniform, side="right"), len(shares) - 1)


class InterleavedSource(DocumentSource):
    """The sources' documents taken in turn (one from each, round robin): what a mixture's tokenizer
    trains on, so that every source contributes to its first ``train_max_bytes``."""

    def __init__(self, sources: list[DocumentSource]):
        self.sources = sources

    def iter_documents(self) -> Iterator[str]:
        iterators = [source.iter_documents() for source in self.sources]
        while iterators:
            for iterator in list(iterators):
                document = next(iterator, None)
                if document is None:
                    iterators.remove(iterator)
                else:
                    yield document

    def fingerprint(self) -> str:
        return stable_hash("interleaved", [source.fingerprint() for source in self.sources])
