"""Token shards: a corpus tokenized once, streaming, into memory-mappable files (``axtorch-tokenize``).

A tokenized directory holds::

    tokenizer.json
    train-00000.tokens, ...    token ids, raw little-endian uint16 (vocabularies up to 65536) or
                               uint32; every document followed by its end-of-document token
    train-00000.lengths, ...   each document's token count (EOS included), uint32: the boundaries
    val-00000.tokens, ...      the held-out documents, likewise
    manifest.json              written last: source fingerprint, tokenizer digest, dtype, and
                               each shard's file, tokens and documents

Tokenizing streams: worker processes encode batches of documents in order while the main process
appends them to the current shard, and a shard closes after ``shard_tokens`` tokens. Each
document goes to the held-out split by the rule every source shares (a seeded hash of its text,
``axtorch.data.held_out``), so the split needs neither a second pass nor the corpus in memory;
memory stays that of a few batches, whatever the corpus size. Only a corpus whose held-out
documents come far from ``val_fraction`` (a handful of documents) is read back once and rewritten
split by tokens, as the in-memory cache splits it. Training reads the shards through
``ShardedTokens``, memory-mapped, never whole (``data=tokenized data.source.path=DIR``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np
from omegaconf import MISSING
from tqdm import tqdm

from axtorch.config.errors import ConfigError
from axtorch.data.files import stable_hash, write_file_atomically
from axtorch.data.held_out import is_held_out, needs_token_split, token_split_size
from axtorch.data.sources import DocumentSource, SourceConfig
from axtorch.data.tokenizer import TOKENIZER_FILE, Tokenizer

MANIFEST_FILE = "manifest.json"
SPLITS = ("train", "val")
_FORMAT = 1
_BATCH_DOCUMENTS = 256


@dataclass
class TokenizedSourceConfig(SourceConfig):
    """A directory that ``axtorch-tokenize`` wrote: training reads its shards instead of tokenizing,
    with its tokenizer in place of ``data.tokenizer``. Built, it yields its documents decoded again."""

    path: str = MISSING

    def build(self) -> TokenShardsSource:
        return TokenShardsSource(Path(self.path).expanduser())

    def pretokenized(self) -> Optional[Path]:
        return Path(self.path).expanduser()


class TokenShardsSource(DocumentSource):
    """A tokenized directory's documents as text (training split, then held-out), e.g. to tokenize
    them again with another tokenizer."""

    def __init__(self, directory: Path):
        self.directory = directory

    def iter_documents(self) -> Iterator[str]:
        tokenizer, _ = read_shards(self.directory)
        manifest = json.loads((self.directory / MANIFEST_FILE).read_text())
        dtype = np.dtype(manifest["dtype"])
        for split in SPLITS:
            files = [
                (self.directory / shard["file"], self.directory / shard["lengths"])
                for shard in manifest["splits"][split]
            ]
            for ids in _shard_documents(files, dtype):
                yield tokenizer.document_text(ids.tolist())

    def fingerprint(self) -> str:
        manifest = json.loads((self.directory / MANIFEST_FILE).read_text())
        return stable_hash("token shards", manifest["source_fingerprint"], manifest["tokenizer_sha256"])


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _shard_documents(files: list[tuple[Path, Path]], dtype: np.dtype) -> Iterator[np.ndarray]:
    """Each document's tokens, memory-mapped, from shards given as (tokens file, lengths file)."""
    for tokens_path, lengths_path in files:
        tokens = np.memmap(tokens_path, dtype=dtype, mode="r")
        start = 0
        for length in np.fromfile(lengths_path, dtype="<u4"):
            yield tokens[start : start + int(length)]
            start += int(length)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _ShardWriter:
    """Appends documents' tokens to ``<split>-NNNNN.tokens`` (and lengths), starting a new shard past a size."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._tokens: Optional[BinaryIO] = None
        self._lengths: Optional[BinaryIO] = None

    def add(self, tokens: np.ndarray) -> None:
        if self._tokens is None or self.shards[-1]["tokens"] >= self.shard_tokens:
            self._open_next()
        assert self._tokens is not None and self._lengths is not None
        self._tokens.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.write(np.array([tokens.size], dtype="<u4").tobytes())
        self.shards[-1]["tokens"] += int(tokens.size)
        self.shards[-1]["documents"] += 1

    def close(self) -> None:
        for handle in (self._tokens, self._lengths):
            if handle is not None:
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
        self._tokens = self._lengths = None

    def _open_next(self) -> None:
        self.close()
        name = f"{self.split}-{len(self.shards):05d}"
        self.shards.append({"file": f"{name}.tokens", "lengths": f"{name}.lengths", "tokens": 0, "documents": 0})
        self._tokens = open(self.directory / f"{name}.tokens", "wb")  # noqa: SIM115 - closed in close()
        self._lengths = open(self.directory / f"{name}.lengths", "wb")  # noqa: SIM115


_worker_tokenizer: Optional[Tokenizer] = None


def _start_worker(tokenizer_path: str, eos_token: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker_tokenizer = Tokenizer.load(Path(tokenizer_path), eos_token)


def _encode(
    tokenizer: Tokenizer, documents: list[str], val_fraction: float, seed: int
) -> list[tuple[np.ndarray, bool]]:
    """Each document's tokens (``Tokenizer.document_ids``), and whether it is held out."""
    return [
        (np.array(ids, dtype=np.uint32), is_held_out(text, val_fraction, seed))
        for text, ids in zip(documents, tokenizer.document_ids(documents))
    ]


def _encode_in_worker(documents: list[str], val_fraction: float, seed: int) -> list[tuple[np.ndarray, bool]]:
    assert _worker_tokenizer is not None
    return _encode(_worker_tokenizer, documents, val_fraction, seed)


def _batches(documents: Iterator[str]) -> Iterator[list[str]]:
    while batch := list(islice(documents, _BATCH_DOCUMENTS)):
        yield batch


def write_shards(
    source: DocumentSource,
    tokenizer: Tokenizer,
    directory: Path,
    *,
    val_fraction: float,
    seed: int,
    workers: int = 1,
    shard_tokens: int = 1 << 28,
) -> dict[str, Any]:
    """Tokenize ``source`` into ``directory`` (which holds ``tokenizer.json``); return the manifest."""
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {split: _ShardWriter(directory, split, dtype, shard_tokens) for split in SPLITS}
    batches = _batches(source.iter_documents())
    pool = None
    if workers > 1:
        context = multiprocessing.get_context("spawn")
        initargs = (str(directory / TOKENIZER_FILE), tokenizer.eos_token)
        pool = context.Pool(workers, initializer=_start_worker, initargs=initargs)
        encode = partial(_encode_in_worker, val_fraction=val_fraction, seed=seed)
        encoded: Iterator[list[tuple[np.ndarray, bool]]] = pool.imap(encode, batches)
    else:
        encoded = (_encode(tokenizer, batch, val_fraction, seed) for batch in batches)
    index = 0
    held_out: set[int] = set()
    try:
        with tqdm(desc="tokenizing", unit=" docs") as progress:
            for documents in encoded:
                for tokens, is_validation in documents:
                    writers["val" if is_validation else "train"].add(tokens)
                    if is_validation:
                        held_out.add(index)
                    index += 1
                progress.update(len(documents))
    finally:
        if pool is not None:
            pool.terminate()
        for writer in writers.values():
            writer.close()
    held_out_tokens = sum(shard["tokens"] for shard in writers["val"].shards)
    total_tokens = held_out_tokens + sum(shard["tokens"] for shard in writers["train"].shards)
    split_by = "documents"
    if needs_token_split(held_out_tokens, total_tokens, val_fraction):
        writers = _split_by_tokens(writers, held_out, index, val_fraction)
        split_by = "tokens"
    if writers["train"].shards == [] or all(shard["tokens"] == shard["documents"] for shard in writers["train"].shards):
        raise ConfigError(
            "data.source", type(source).__name__, "a source whose documents contain text", reason="no text to train on"
        )
    manifest = {
        "format": _FORMAT,
        "source_fingerprint": source.fingerprint(),
        "tokenizer_sha256": file_digest(directory / TOKENIZER_FILE),
        "vocab_size": tokenizer.vocab_size,
        "eos_token": tokenizer.eos_token,
        "eos_id": tokenizer.eos_id,
        "dtype": dtype.str,
        "val_fraction": val_fraction,
        "seed": seed,
        "documents": index,
        "split_by": split_by,
        "splits": {split: writer.shards for split, writer in writers.items()},
    }
    write_file_atomically(directory / MANIFEST_FILE, lambda file: file.write(json.dumps(manifest, indent=1).encode()))
    return manifest


def _split_by_tokens(
    writers: dict[str, _ShardWriter], held_out: set[int], documents: int, fraction: float
) -> dict[str, _ShardWriter]:
    """The shards rewritten as the corpus in order, its last ``token_split_size`` tokens held out
    (``axtorch.data.held_out``): the split the in-memory cache makes of the same corpus.

    The shards written by document are read back once, memory-mapped, with the held-out documents
    put back in their places (``held_out``: their indices); the document the cut falls in is split
    in two, its head trained on.
    """
    train, val = writers["train"], writers["val"]
    old: dict[str, list[tuple[Path, Path]]] = {split: [] for split in SPLITS}
    for split, writer in writers.items():
        for shard in writer.shards:
            tokens_path, lengths_path = (
                writer.directory / f".{shard[kind]}.by-document" for kind in ("file", "lengths")
            )
            (writer.directory / shard["file"]).rename(tokens_path)
            (writer.directory / shard["lengths"]).rename(lengths_path)
            old[split].append((tokens_path, lengths_path))
    total = sum(shard["tokens"] for shard in train.shards + val.shards)
    cut = total - token_split_size(total, fraction)
    new = {split: _ShardWriter(train.directory, split, train.dtype, train.shard_tokens) for split in SPLITS}
    streams = {split: _shard_documents(old[split], train.dtype) for split in SPLITS}
    written = 0
    try:
        for index in range(documents):
            tokens = next(streams["val" if index in held_out else "train"])
            head = min(max(cut - written, 0), tokens.size)
            if head:
                new["train"].add(tokens[:head])
            if head < tokens.size:
                new["val"].add(tokens[head:])
            written += tokens.size
    finally:
        for writer in new.values():
            writer.close()
    for files in old.values():
        for tokens_path, lengths_path in files:
            tokens_path.unlink()
            lengths_path.unlink()
    return new


class ShardedTokens:
    """A split's shards as one read-only token stream, indexed like a numpy array, memory-mapped."""

    def __init__(self, files: list[Path], dtype: np.dtype):
        self.dtype = dtype
        self.parts = [np.memmap(f, dtype=dtype, mode="r") for f in files if f.stat().st_size > 0]
        self.starts = np.cumsum([0] + [part.size for part in self.parts])

    @property
    def size(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        """The tokens at ``positions`` (any shape of absolute indices)."""
        flat = np.asarray(positions, dtype=np.int64).ravel()
        shard = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.dtype)
        for index in np.unique(shard):
            chosen = shard == index
            out[chosen] = self.parts[index][flat[chosen] - self.starts[index]]
        return out.reshape(np.shape(positions))


def read_shards(directory: Path) -> tuple[Tokenizer, dict[str, ShardedTokens]]:
    """The tokenizer and each split's tokens of a tokenized directory, checked against its manifest."""
    key = "data.source.path"
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ConfigError(key, str(directory), "a directory that axtorch-tokenize completed", reason="no manifest.json")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != _FORMAT:
        raise ConfigError(key, str(directory), f"token shards of format {_FORMAT}", reason=f"{manifest.get('format')}")
    if file_digest(directory / TOKENIZER_FILE) != manifest["tokenizer_sha256"]:
        raise ConfigError(
            key, str(directory), "its own tokenizer.json", reason="tokenizer.json changed since tokenizing"
        )
    dtype = np.dtype(manifest["dtype"])
    splits = {}
    for split in SPLITS:
        for shard in manifest["splits"][split]:
            size = (directory / shard["file"]).stat().st_size if (directory / shard["file"]).exists() else -1
            if size != shard["tokens"] * dtype.itemsize:
                raise ConfigError(
                    key, str(directory), "shards of the sizes in its manifest", reason=f"{shard['file']}: {size} bytes"
                )
        splits[split] = ShardedTokens([directory / shard["file"] for shard in manifest["splits"][split]], dtype)
    return Tokenizer.load(directory / TOKENIZER_FILE, manifest["eos_token"]), splits
