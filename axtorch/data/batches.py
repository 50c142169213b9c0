"""What a loader hands the trainer: batches of next-token pairs, and a resumable training iterator."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, Protocol

import numpy as np
import torch

from axtorch.data.tokenizer import Tokenizer

Batch = dict[str, torch.Tensor]


def to_batch(windows: np.ndarray) -> Batch:
    """Split ``[B, S + 1]`` windows into ``input_ids`` and next-token ``labels``, both ``[B, S]`` int64."""
    tokens = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64))
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


class Windows(Protocol):
    """Numbered token windows of ``seq_len + 1`` tokens (packed sequences, or held-out windows in memory)."""

    def __len__(self) -> int: ...

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Windows ``indices`` as an int64 array ``[len(indices), seq_len + 1]``."""
        ...


def iter_validation_batches(windows: Windows, batch_size: int, max_batches: Optional[int] = None) -> Iterator[Batch]:
    """Windows in order; the last partial batch is dropped unless it is the only one."""
    check_batch_size(batch_size)
    count = len(windows)
    num_batches = count // batch_size if count >= batch_size else min(count, 1)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    for batch in range(num_batches):
        indices = np.arange(batch * batch_size, min((batch + 1) * batch_size, count))
        yield to_batch(windows.gather(indices))


class TrainBatches(Iterator[Batch], Protocol):
    """One data-parallel rank's rows of every global training batch, resumable from a checkpoint.

    A checkpoint holds ``combine`` of every rank's ``state_dict`` (in rank order), and
    ``load_state_dict`` takes that combined state on any number of ranks.
    """

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the position of the next batch, JSON-serialisable."""
        ...

    def combine(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """The position of the next global batch, from every rank's ``state_dict``."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DataModule(Protocol):
    """What the trainer needs from the data: the tokenizer and the train and validation batches."""

    tokenizer: Tokenizer
    tokenizer_path: Path

    def train_batches(
        self, global_batch_size: int, data_parallel_rank: int = 0, data_parallel_size: int = 1
    ) -> TrainBatches:
        """Rank ``data_parallel_rank`` of ``data_parallel_size``'s rows of each global batch: its
        ``global_batch_size / data_parallel_size`` consecutive rows."""
        ...

    def val_batches(self, batch_size: int, max_batches: Optional[int] = None) -> Iterator[Batch]:
        """Whole (global) held-out batches, the same on every rank."""
        ...
