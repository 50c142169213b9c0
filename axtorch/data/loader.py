"""Batches of packed sequences: a shuffled, resumable training stream and a fixed validation pass.

The training order is a pure function of (seed, epoch, batch index), so a run restored from a
checkpoint sees exactly the batches an uninterrupted run would have seen, on any number of
data-parallel ranks. A corpus read while training goes through ``axtorch.data.streaming`` instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from axtorch.data.batches import Batch, DataModule, Windows, check_batch_size, iter_validation_batches, to_batch
from axtorch.data.config import DataConfig
from axtorch.data.document_tokens import mark_starts_after
from axtorch.data.packing import PackedSequences, prepare_corpus, validate_data_config
from axtorch.data.streaming import build_streaming_data
from axtorch.data.tokenizer import Tokenizer

__all__ = ["Batch", "BatchIterator", "DataModule", "PackedDataModule", "build_data", "iter_validation_batches"]


class BatchIterator(Iterator[Batch]):
    """Endless training batches: each epoch is a fresh permutation, its ragged tail dropped.

    Epoch ``e`` permutes the sequence indices with ``torch.Generator().manual_seed(seed *
    1_000_003 + e)`` and global batch ``i`` takes slice ``[i * B, (i + 1) * B)`` of that
    permutation; rank ``r`` of ``R`` gathers only its ``B / R`` consecutive rows of it.
    """

    def __init__(
        self,
        sequences: Windows,
        batch_size: int,
        seed: int,
        rank: int = 0,
        ranks: int = 1,
        document_masking: bool = False,
    ):
        check_batch_size(batch_size)
        if batch_size % ranks or not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} of {ranks} cannot take an equal share of batch_size={batch_size}")
        self.batches_per_epoch = len(sequences) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"batch_size={batch_size} exceeds the {len(sequences)} training sequences; "
                "lower the batch size or data.seq_len, or use a larger corpus"
            )
        self._sequences = sequences
        self._batch_size = batch_size
        self._rows = slice(rank * batch_size // ranks, (rank + 1) * batch_size // ranks)
        self._seed = seed
        self._document_masking = document_masking
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
        indices = self._permutation_for(self._epoch)[start : start + self._batch_size][self._rows]
        self._index += 1
        if self._index == self.batches_per_epoch:
            self._epoch, self._index = self._epoch + 1, 0
        return to_batch(self._sequences.gather(indices), self._document_masking)

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch, JSON-serialisable (the same on every rank)."""
        return {"epoch": self._epoch, "index": self._index}

    def combine(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        if any(state != states[0] for state in states):
            raise RuntimeError(f"data-parallel ranks disagree on the data position: {states}")
        return states[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "epoch" not in state:
            raise ValueError(
                f"data iterator state {sorted(state)} was saved by the streaming loader; "
                "resume with the data config the checkpoint was trained with"
            )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.batches_per_epoch:
            raise ValueError(
                f"data iterator state {state} is out of range: epoch must be >= 0 and index in "
                f"[0, {self.batches_per_epoch}); was the checkpoint made with another batch size or corpus?"
            )
        self._epoch, self._index = epoch, index


class DocumentWindows:
    """Windows of a cached token stream (plain ids) with their documents' starts flagged: each
    document there ends with the end-of-sequence token (``Windows``)."""

    def __init__(self, windows: Windows, eos_id: int):
        self._windows = windows
        self._eos_id = eos_id

    def __len__(self) -> int:
        return len(self._windows)

    def gather(self, indices: np.ndarray) -> np.ndarray:
        return mark_starts_after(self._windows.gather(indices), self._eos_id)


class PackedDataModule:
    """A corpus tokenized up front: memory-mapped token arrays cut into windows (``packing.py``).

    With ``document_masking`` its documents are told apart by the end-of-sequence token that
    ends each (``DocumentWindows``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        tokenizer_path: Path,
        train: PackedSequences,
        val: PackedSequences,
        seed: int,
        document_masking: bool = False,
    ):
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self._train: Windows = DocumentWindows(train, tokenizer.eos_id) if document_masking else train
        self._val: Windows = DocumentWindows(val, tokenizer.eos_id) if document_masking else val
        self._seed = seed
        self._document_masking = document_masking

    @property
    def train_num_sequences(self) -> int:
        return len(self._train)

    @property
    def val_num_sequences(self) -> int:
        return len(self._val)

    def train_batches(
        self, global_batch_size: int, data_parallel_rank: int = 0, data_parallel_size: int = 1
    ) -> BatchIterator:
        return BatchIterator(
            self._train, global_batch_size, self._seed, data_parallel_rank, data_parallel_size, self._document_masking
        )

    def val_batches(self, batch_size: int, max_batches: Optional[int] = None) -> Iterator[Batch]:
        return iter_validation_batches(self._val, batch_size, max_batches, self._document_masking)


def build_data(cfg: DataConfig) -> DataModule:
    """The data ``cfg`` describes: streamed while training, or tokenized (and cached) up front."""
    validate_data_config(cfg)
    streaming = build_streaming_data(cfg)
    if streaming is not None:
        return streaming
    corpus = prepare_corpus(cfg)
    return PackedDataModule(
        tokenizer=corpus.tokenizer,
        tokenizer_path=corpus.tokenizer_path,
        train=PackedSequences(corpus.train_tokens, cfg.seq_len, "train"),
        val=PackedSequences(corpus.val_tokens, cfg.seq_len, "validation"),
        seed=cfg.seed,
        document_masking=cfg.document_masking,
    )
