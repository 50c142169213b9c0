"""Batches of packed sequences: a shuffled, resumable training stream and a fixed validation pass.

The training order is a pure function of (seed, epoch, batch index), so a run restored from a
checkpoint sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from axtorch.data.config import DataConfig
from axtorch.data.packing import PackedSequences, prepare_corpus
from axtorch.data.tokenizer import Tokenizer

Batch = dict[str, torch.Tensor]


def to_batch(windows: np.ndarray) -> Batch:
    """Split ``[B, S + 1]`` windows into ``input_ids`` and next-token ``labels``, both ``[B, S]`` int64."""
    tokens = torch.from_numpy(windows)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


class BatchIterator(Iterator[Batch]):
    """Endless training batches: each epoch is a fresh permutation, its ragged tail dropped.

    Epoch ``e`` permutes the sequence indices with ``torch.Generator().manual_seed(seed *
    1_000_003 + e)`` and batch ``i`` takes slice ``[i * B, (i + 1) * B)`` of that permutation.
    """

    def __init__(self, sequences: PackedSequences, batch_size: int, seed: int):
        _check_batch_size(batch_size)
        self.batches_per_epoch = len(sequences) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"batch_size={batch_size} exceeds the {len(sequences)} training sequences; "
                "lower the batch size or data.seq_len, or use a larger corpus"
            )
        self._sequences = sequences
        self._batch_size = batch_size
        self._seed = seed
        self._epoch = 0
        self._index = 0
        self._permutation_epoch = -1
        self._permutation = np.empty(0, dtype=np.int64)

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._epoch

    def _permutation_for(self, epoch: int) -> np.ndarray:
        if epoch != self._permutation_epoch:
            generator = torch.Generator().manual_seed(self._seed * 1_000_003 + epoch)
            self._permutation = torch.randperm(len(self._sequences), generator=generator).numpy()
            self._permutation_epoch = epoch
        return self._permutation

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        start = self._index * self._batch_size
        indices = self._permutation_for(self._epoch)[start : start + self._batch_size]
        self._index += 1
        if self._index == self.batches_per_epoch:
            self._epoch, self._index = self._epoch + 1, 0
        return to_batch(self._sequences.gather(indices))

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch, JSON-serialisable."""
        return {"epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.batches_per_epoch:
            raise ValueError(
                f"data iterator state {state} is out of range: epoch must be >= 0 and index in "
                f"[0, {self.batches_per_epoch}); was the checkpoint made with another batch size or corpus?"
            )
        self._epoch, self._index = epoch, index


def iter_validation_batches(
    sequences: PackedSequences, batch_size: int, max_batches: Optional[int] = None
) -> Iterator[Batch]:
    """Sequences in order; the last partial batch is dropped unless it is the only one."""
    _check_batch_size(batch_size)
    count = len(sequences)
    num_batches = count // batch_size if count >= batch_size else min(count, 1)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    for batch in range(num_batches):
        indices = np.arange(batch * batch_size, min((batch + 1) * batch_size, count))
        yield to_batch(sequences.gather(indices))


class DataModule:
    """What the trainer needs from the data: the tokenizer and the train and validation batches."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        tokenizer_path: Path,
        train: PackedSequences,
        val: PackedSequences,
        seed: int,
    ):
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self._train = train
        self._val = val
        self._seed = seed

    @property
    def train_num_sequences(self) -> int:
        return len(self._train)

    @property
    def val_num_sequences(self) -> int:
        return len(self._val)

    def train_batches(self, batch_size: int) -> BatchIterator:
        return BatchIterator(self._train, batch_size, self._seed)

    def val_batches(self, batch_size: int, max_batches: Optional[int] = None) -> Iterator[Batch]:
        return iter_validation_batches(self._val, batch_size, max_batches)


def build_data(cfg: DataConfig) -> DataModule:
    """Load (or tokenize and cache) the corpus described by ``cfg``."""
    corpus = prepare_corpus(cfg)
    return DataModule(
        tokenizer=corpus.tokenizer,
        tokenizer_path=corpus.tokenizer_path,
        train=PackedSequences(corpus.train_tokens, cfg.seq_len, "train"),
        val=PackedSequences(corpus.val_tokens, cfg.seq_len, "validation"),
        seed=cfg.seed,
    )
