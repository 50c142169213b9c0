"""A corpus read, tokenized and packed while training: nothing proportional to its size is held.

The corpus is read as ``V = data.streams`` virtual streams (by default one per row of the global
batch), the disjoint parts of a
``PartitionedSource``. Each stream packs on its own, as ``packing.py`` does the whole corpus:
its documents, each followed by EOS, joined into one token stream cut into windows of
``seq_len + 1`` tokens that overlap by one. Row ``j`` of a global batch of ``B`` rows comes from
stream ``j // (B / V)``; data-parallel rank ``r`` of ``W`` owns streams ``[r V / W, (r + 1) V / W)``,
which are exactly its rows ``[r B / W, (r + 1) B / W)``, and reads nothing else. So the global
batches are the same for every ``W`` that divides ``V``.

A stream's state is its position in its part (where the next document starts), the epoch, and the
tokens it carries into its next window; the checkpoint holds every stream's, gathered from the
ranks, and a resume on any number of ranks seeks each stream back to its position. A stream that
reaches the end of its part starts it again (the next epoch), in the same order: shuffle a corpus
before streaming it.

Held-out documents are chosen by the rule every source shares, a seeded hash of their text
(``axtorch.data.held_out``; ``data.val_fraction``, ``data.seed``): training skips them, and
validation packs the first held-out documents of the corpus, in order, until it has
``eval_batches`` batches, held in memory (their size is set by the evaluation, not the corpus).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any, Optional

import numpy as np

from axtorch.config.errors import ConfigError
from axtorch.data.batches import Batch, iter_validation_batches, to_batch
from axtorch.data.config import DataConfig
from axtorch.data.corpus_tokenizer import load_or_train_tokenizer
from axtorch.data.files import stable_hash
from axtorch.data.held_out import is_held_out
from axtorch.data.mixture import InterleavedSource, mixture_sources, row_sources
from axtorch.data.packing import ENCODE_BATCH_DOCUMENTS
from axtorch.data.sources import PartitionedSource
from axtorch.data.tokenizer import TOKENIZER_FILE, Tokenizer, tokenizer_fingerprint

_STATE_FORMAT = 1


class PackedStream:
    """One part of one source, tokenized as it is read and cut into windows of ``seq_len + 1`` tokens.

    ``held_out`` picks which documents it keeps (training: those not held out, read again and
    again; validation: the held-out ones, read once). The source encodes its documents
    (``PartitionedSource.encode_documents``); ``document_masking`` flags where each starts.
    """

    def __init__(
        self,
        source: PartitionedSource,
        part: int,
        parts: int,
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        val_fraction: float,
        seed: int,
        held_out: bool = False,
        document_masking: bool = False,
    ):
        self.source, self.part, self.parts = source, part, parts
        self.document_masking = document_masking
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self._val_fraction, self._seed, self._held_out = val_fraction, seed, held_out
        self._epoch = 0
        self._position = 0
        self._carry = np.empty(0, dtype=np.int64)
        self._documents: Optional[Iterator[tuple[str, int, int]]] = None
        #: Tokenized documents not yet in ``_carry``: (tokens, epoch, position after the document).
        self._pending: deque[tuple[np.ndarray, int, int]] = deque()

    def _read(self) -> Iterator[tuple[str, int, int]]:
        """(text, epoch, position after it) of the documents this stream keeps, from its saved position."""
        epoch, position = self._epoch, self._position
        while True:
            kept = False
            for text, after in self.source.read_part(self.part, self.parts, position):
                if is_held_out(text, self._val_fraction, self._seed) == self._held_out:
                    kept = True
                    yield text, epoch, after
            if self._held_out:
                return
            if not kept and position == 0:
                raise ValueError(
                    f"virtual stream {self.part} of {self.parts} of {type(self.source).__name__} has no "
                    "training documents; lower data.streams or use a larger corpus"
                )
            epoch, position = epoch + 1, 0

    def _tokenize_more(self) -> bool:
        """Tokenize the next few documents into ``_pending``; False when a held-out stream has ended."""
        if self._documents is None:
            self._documents = self._read()
        documents = list(islice(self._documents, ENCODE_BATCH_DOCUMENTS))
        texts = [text for text, _, _ in documents]
        encoded = self.source.encode_documents(texts, self.tokenizer, self.document_masking)
        for (_, epoch, after), tokens in zip(documents, encoded):
            self._pending.append((tokens, epoch, after))
        return bool(documents)

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` windows, ``[count, seq_len + 1]`` int64 (fewer only at a held-out stream's end)."""
        width = self.seq_len + 1
        rows: list[np.ndarray] = []
        while len(rows) < count:
            while self._carry.size < width:
                if not self._pending and not self._tokenize_more():
                    return np.stack(rows) if rows else np.empty((0, width), dtype=np.int64)
                tokens, self._epoch, self._position = self._pending.popleft()
                self._carry = np.concatenate([self._carry, tokens])
            rows.append(self._carry[:width])
            self._carry = self._carry[self.seq_len :]
        return np.stack(rows)

    def state_dict(self) -> dict[str, Any]:
        """Where the next window starts: the position after the last document in it, and the carry."""
        return {"epoch": self._epoch, "position": self._position, "carry": self._carry.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._carry = np.array(state["carry"], dtype=np.int64)
        self._documents = None
        self._pending.clear()


def check_stream_layout(streams: int, batch_size: int, replicas: int) -> None:
    """Every rank owns whole virtual streams, and every stream feeds whole rows of each batch."""
    if streams % replicas or batch_size % streams:
        allowed = [v for v in range(replicas, batch_size + 1, replicas) if batch_size % v == 0]
        raise ConfigError(
            "data.streams",
            streams,
            f"a multiple of the {replicas} data-parallel replicas that divides trainer.batch_size={batch_size}: "
            f"{allowed}",
        )


class StreamingBatches(Iterator[Batch]):
    """One rank's rows of every global batch, from the virtual streams it owns.

    ``streams[s][k]`` is source ``s``'s stream ``first + k``; row ``j`` of step ``t`` takes the next
    window of source ``row_sources(seed, t)[j]`` in its stream, so a mixture's draws, like the rows,
    are the same on any number of ranks.
    """

    def __init__(
        self,
        streams: list[list[PackedStream]],
        shares: list[float],
        seed: int,
        batch_size: int,
        first: int,
        total: int,
        document_masking: bool = False,
    ):
        self._streams = streams
        self._document_masking = document_masking
        self._shares = shares
        self._seed = seed
        self._batch_size = batch_size
        self._first = first
        self._total = total
        self._rows_per_stream = batch_size // total
        self._step = 0

    def __iter__(self) -> StreamingBatches:
        return self

    def __next__(self) -> Batch:
        sources = row_sources(self._seed, self._step, self._batch_size, self._shares)
        windows = []
        for owned in range(len(self._streams[0])):
            stream = self._first + owned
            for row in range(stream * self._rows_per_stream, (stream + 1) * self._rows_per_stream):
                windows.append(self._streams[sources[row]][owned].take(1))
        self._step += 1
        return to_batch(np.concatenate(windows), self._document_masking)

    def _layout(self) -> dict[str, int]:
        return {"format": _STATE_FORMAT, "streams": self._total, "sources": len(self._streams)}

    def state_dict(self) -> dict[str, Any]:
        """The step and this rank's streams, keyed ``"<source>/<stream>"``."""
        owned = {
            f"{source}/{self._first + index}": stream.state_dict()
            for source, streams in enumerate(self._streams)
            for index, stream in enumerate(streams)
        }
        return {**self._layout(), "step": self._step, "positions": owned}

    def combine(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        if any(state["step"] != states[0]["step"] for state in states):
            raise RuntimeError(f"data-parallel ranks disagree on the step: {[state['step'] for state in states]}")
        positions = {key: value for state in states for key, value in state["positions"].items()}
        return {**self._layout(), "step": states[0]["step"], "positions": positions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {key: state.get(key) for key in self._layout()}
        if saved != self._layout():
            raise ValueError(
                f"the checkpoint's data state was saved with {saved}, this run reads {self._layout()} "
                "(format, data.streams, mixture sources); resume with the data config it was trained with"
            )
        for source, streams in enumerate(self._streams):
            for index, stream in enumerate(streams):
                stream.load_state_dict(state["positions"][f"{source}/{self._first + index}"])
        self._step = int(state["step"])


class HeldOutWindows:
    """Validation windows, packed once and kept in memory (``Windows``)."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def gather(self, indices: np.ndarray) -> np.ndarray:
        return self.rows[indices]


class StreamingDataModule:
    """A streamed corpus (one source or a weighted mixture): the ``DataModule`` the trainer reads."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        tokenizer_path: Path,
        sources: list[tuple[PartitionedSource, float]],
        cfg: DataConfig,
    ):
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self._sources = sources
        self._cfg = cfg
        self._val: dict[int, HeldOutWindows] = {}

    def _stream(self, source: PartitionedSource, part: int, parts: int, held_out: bool = False) -> PackedStream:
        cfg = self._cfg
        return PackedStream(
            source,
            part,
            parts,
            self.tokenizer,
            cfg.seq_len,
            val_fraction=cfg.val_fraction,
            seed=cfg.seed,
            held_out=held_out,
            document_masking=cfg.document_masking,
        )

    def train_batches(
        self, global_batch_size: int, data_parallel_rank: int = 0, data_parallel_size: int = 1
    ) -> StreamingBatches:
        total = self._cfg.streams or global_batch_size
        check_stream_layout(total, global_batch_size, data_parallel_size)
        owned = total // data_parallel_size
        first = data_parallel_rank * owned
        streams = [
            [self._stream(source, part, total) for part in range(first, first + owned)] for source, _ in self._sources
        ]
        shares = [share for _, share in self._sources]
        return StreamingBatches(
            streams, shares, self._cfg.seed, global_batch_size, first, total, self._cfg.document_masking
        )

    def val_batches(self, batch_size: int, max_batches: Optional[int] = None) -> Iterator[Batch]:
        if max_batches is None:
            raise ValueError("a streamed corpus is evaluated on a bounded number of batches: pass max_batches")
        wanted = batch_size * max_batches
        if wanted not in self._val:
            rows = [np.empty((0, self._cfg.seq_len + 1), dtype=np.int64)]
            if self._cfg.val_fraction > 0:
                rows += [
                    self._stream(source, 0, 1, held_out=True).take(math.ceil(share * wanted))
                    for source, share in self._sources
                ]
            self._val[wanted] = HeldOutWindows(np.concatenate(rows))
        return iter_validation_batches(self._val[wanted], batch_size, max_batches, self._cfg.document_masking)


def build_streaming_data(cfg: DataConfig) -> Optional[StreamingDataModule]:
    """The streamed corpus of ``cfg`` (``streaming=true`` or a mixture), None for one read up front.

    Only the tokenizer is cached (trained on the first ``data.tokenizer.train_max_bytes`` of the
    corpus, a mixture's sources taken in turn), keyed by the sources and the tokenizer settings.
    """
    if cfg.mixture is not None:
        sources = mixture_sources(cfg.mixture)
    else:
        assert cfg.source is not None  # DataConfig.validate
        streaming = cfg.source.build_streaming()
        if streaming is None:
            return None
        sources = [(streaming, 1.0)]
    corpus = sources[0][0] if len(sources) == 1 else InterleavedSource([source for source, _ in sources])
    identity = {
        "streaming": _STATE_FORMAT,
        "corpus": corpus.fingerprint(),
        "tokenizer": tokenizer_fingerprint(cfg.tokenizer),
    }
    directory = Path(cfg.cache_dir).expanduser() / stable_hash(identity)
    tokenizer = load_or_train_tokenizer(cfg.tokenizer, corpus, directory)
    return StreamingDataModule(tokenizer, directory / TOKENIZER_FILE, sources, cfg)
