"""What a loader hands the trainer: batches of next-token pairs, and a resumable training iterator."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, Protocol

import numpy as np
import torch

from axtorch.data.document_tokens import DOCUMENT_START, NOT_TARGET, TOKEN_ID
from axtorch.data.tokenizer import Tokenizer

Batch = dict[str, torch.Tensor]

#: The label of a token no loss is taken on (``loss.ignore_index``'s default).
IGNORED_LABEL = -100


def to_batch(windows: np.ndarray, document_masking: bool = False) -> Batch:
    """Split ``[B, S + 1]`` windows into ``input_ids`` and next-token ``labels``, both ``[B, S]`` int64.

    Tokens flagged ``NOT_TARGET`` (``document_tokens``) get ``IGNORED_LABEL``. With
    ``document_masking`` the batch also holds ``segment_ids`` (a row's documents, from its
    ``DOCUMENT_START`` flags; the row's first token starts one) and ``positions`` that restart at 0
    in each, and a document's last token predicts nothing (its label would be the next one's first).
    """
    tokens = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64))
    ids = tokens & TOKEN_ID
    labels = ids[:, 1:].clone()
    untargeted = (tokens[:, 1:] & NOT_TARGET) != 0
    batch = {"input_ids": ids[:, :-1].contiguous()}
    if document_masking:
        starts = (tokens[:, :-1] & DOCUMENT_START) != 0
        starts[:, 0] = True
        untargeted |= (tokens[:, 1:] & DOCUMENT_START) != 0
        index = torch.arange(starts.shape[1]).expand_as(starts)
        batch["segment_ids"] = starts.long().cumsum(1)
        batch["positions"] = index - torch.where(starts, index, 0).cummax(1).values
    labels[untargeted] = IGNORED_LABEL
    batch["labels"] = labels
    return batch


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


class Windows(Protocol):
    """Numbered token windows of ``seq_len + 1`` tokens (packed sequences, or held-out windows in memory)."""

    def __len__(self) -> int: ...

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Windows ``indices`` as an int64 array ``[len(indices), seq_len + 1]``."""
        ...


def iter_validation_batches(
    windows: Windows, batch_size: int, max_batches: Optional[int] = None, document_masking: bool = False
) -> Iterator[Batch]:
    """Windows in order; the last partial batch is dropped unless it is the only one."""
    check_batch_size(batch_size)
    count = len(windows)
    num_batches = count // batch_size if count >= batch_size else min(count, 1)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    for batch in range(num_batches):
        indices = np.arange(batch * batch_size, min((batch + 1) * batch_size, count))
        yield to_batch(windows.gather(indices), document_masking)


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
