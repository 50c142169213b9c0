"""Tokenize a corpus once, split it into training and held-out tokens, and cache both as ``.npy`` files.

The split is by document, so that no held-out text is trained on, and by the rule every source
shares (``axtorch.data.held_out``). A corpus of too few documents for that (one book, a handful
of files) is split by tokens instead: its last ``val_fraction`` of tokens are held out.

A cache entry is ``<cache_dir>/<key>/`` with ``tokenizer.json``, ``train_tokens.npy``,
``val_tokens.npy`` and ``meta.json``. The key covers everything the arrays depend on (corpus
fingerprint, tokenizer identity, split settings), so an entry is never stale; ``meta.json`` is
written last and marks the entry complete. Every file is written to a temporary name and renamed,
so an interrupted run leaves either nothing or a whole file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any, Union

import numpy as np
from tqdm import tqdm

from axtorch.config.errors import ConfigError
from axtorch.data.config import DataConfig
from axtorch.data.corpus_tokenizer import load_or_train_tokenizer
from axtorch.data.files import stable_hash, write_file_atomically
from axtorch.data.held_out import is_held_out, needs_token_split, token_split_size
from axtorch.data.shards import ShardedTokens, read_shards, token_dtype
from axtorch.data.sources import DocumentSource
from axtorch.data.tokenizer import (
    TOKENIZER_FILE,
    Tokenizer,
    tokenizer_fingerprint,
    validate_tokenizer_config,
)

TRAIN_TOKENS_FILE = "train_tokens.npy"
VAL_TOKENS_FILE = "val_tokens.npy"
META_FILE = "meta.json"
# Bump when the layout or meaning of cached arrays changes, so old entries are not reused.
_CACHE_FORMAT = 3  # 3: documents held out by a hash of their text (axtorch.data.held_out)
#: Documents tokenized in one ``encode_batch`` call: amortises the call, bounds the read-ahead.
ENCODE_BATCH_DOCUMENTS = 64


def validate_data_config(cfg: DataConfig) -> None:
    """Reject a bad ``data`` section before any file is read or any token is made."""
    cfg.validate()
    validate_tokenizer_config(cfg.tokenizer)


def _batched(documents: Iterator[str], size: int) -> Iterator[list[str]]:
    while batch := list(islice(documents, size)):
        yield batch


def tokenize_documents(
    source: DocumentSource, tokenizer: Tokenizer, val_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All documents' tokens, each as ``Tokenizer.document_ids`` makes it (BOS if the model's
    tokenizer adds one, EOS after), each document's length, and whether it is held out
    (``axtorch.data.held_out``).

    The whole stream is held in memory (2 bytes a token for vocabularies up to 65536), which is
    what lets the split fall back to the stream's last tokens once all are known.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    chunks: list[np.ndarray] = []
    lengths: list[int] = []
    held_out: list[bool] = []
    with tqdm(desc="tokenizing", unit=" docs") as progress:
        for documents in _batched(source.iter_documents(), ENCODE_BATCH_DOCUMENTS):
            encoded = tokenizer.document_ids(documents)
            batch_lengths = [len(ids) for ids in encoded]
            flat = chain.from_iterable(encoded)
            chunks.append(np.fromiter(flat, dtype=dtype, count=sum(batch_lengths)))
            lengths.extend(batch_lengths)
            held_out.extend(is_held_out(text, val_fraction, seed) for text in documents)
            progress.update(len(documents))
    if not lengths:
        raise ConfigError(
            "data.source", type(source).__name__, "a source that yields documents", reason="it yielded none"
        )
    return np.concatenate(chunks), np.array(lengths, dtype=np.int64), np.array(held_out, dtype=bool)


def split_by_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the stream's last ``val_fraction`` of tokens held out, the rest trained on."""
    cut = tokens.size - token_split_size(tokens.size, val_fraction)
    return tokens[:cut], tokens[cut:]


def split_corpus(
    tokens: np.ndarray, document_lengths: np.ndarray, is_validation: np.ndarray, val_fraction: float
) -> tuple[np.ndarray, np.ndarray, str]:
    """(train, validation, how): by document, unless that holds out under a quarter or over twice ``val_fraction``.

    Whole documents keep held-out text unseen, but with few documents the draw can hold out
    nothing (one document), far too little (a short one) or most of the corpus (a long one);
    then the tokens are split instead (``axtorch.data.held_out``).
    """
    train, val = split_by_document(tokens, document_lengths, is_validation)
    if needs_token_split(val.size, tokens.size, val_fraction):
        train, val = split_by_tokens(tokens, val_fraction)
        return train, val, "tokens"
    return train, val, "documents"


def split_by_document(
    tokens: np.ndarray, document_lengths: np.ndarray, is_validation: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token streams, each the in-order concatenation of its documents."""
    token_is_validation = np.repeat(is_validation, document_lengths)
    return tokens[~token_is_validation], tokens[token_is_validation]


#: A split's tokens, memory-mapped: one ``.npy`` array (the cache) or shards (``axtorch-tokenize``).
TokenStream = Union[np.ndarray, ShardedTokens]


@dataclass(frozen=True)
class PackedCorpus:
    """A complete cache entry (or tokenized directory): the tokenizer and the train/validation token streams."""

    directory: Path
    tokenizer: Tokenizer
    train_tokens: TokenStream
    val_tokens: TokenStream

    @property
    def tokenizer_path(self) -> Path:
        return self.directory / TOKENIZER_FILE


def _pack(
    directory: Path, source: DocumentSource, tokenizer: Tokenizer, cfg: DataConfig, identity: dict[str, Any]
) -> None:
    """Tokenize and split the corpus into ``directory``; meta.json also records ``identity``."""
    tokens, lengths, held_out = tokenize_documents(source, tokenizer, cfg.val_fraction, cfg.seed)
    if (lengths <= 1).all():  # every document is only its end-of-document token
        raise ConfigError(
            "data.source",
            type(cfg.source).__name__,
            "a source whose documents contain text",
            reason=f"its {len(lengths)} document(s) are empty",
        )
    train, val, split = split_corpus(tokens, lengths, held_out, cfg.val_fraction)
    write_file_atomically(directory / TRAIN_TOKENS_FILE, lambda file: np.save(file, train))
    write_file_atomically(directory / VAL_TOKENS_FILE, lambda file: np.save(file, val))
    meta = {
        **identity,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": str(tokens.dtype),
        "documents": len(lengths),
        "split_by": split,
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
    }
    write_file_atomically(directory / META_FILE, lambda file: file.write(json.dumps(meta, indent=2).encode()))


def prepare_corpus(cfg: DataConfig) -> PackedCorpus:
    """Validate ``cfg``, then load its cache entry, tokenizing and writing it first if absent.

    A source that names token shards (``data=tokenized``) is read from them instead.
    """
    validate_data_config(cfg)
    if cfg.source is None:
        raise ConfigError("data.source", None, "one source to tokenize up front (a mixture streams)")
    shards = cfg.source.pretokenized()
    if shards is not None:
        tokenizer, splits = read_shards(shards)
        return PackedCorpus(shards, tokenizer, splits["train"], splits["val"])
    source = cfg.source.build()
    identity = {
        "format": _CACHE_FORMAT,
        "source_fingerprint": source.fingerprint(),
        "tokenizer_fingerprint": tokenizer_fingerprint(cfg.tokenizer),
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
    }
    directory = Path(cfg.cache_dir).expanduser() / stable_hash(identity)
    tokenizer = load_or_train_tokenizer(cfg.tokenizer, source, directory)
    if not (directory / META_FILE).exists():
        _pack(directory, source, tokenizer, cfg, identity)
    return PackedCorpus(
        directory=directory,
        tokenizer=tokenizer,
        train_tokens=np.load(directory / TRAIN_TOKENS_FILE, mmap_mode="r"),
        val_tokens=np.load(directory / VAL_TOKENS_FILE, mmap_mode="r"),
    )


class PackedSequences:
    """One split's token stream cut into overlapping windows of ``seq_len + 1`` tokens.

    Window ``i`` is ``tokens[i * seq_len : (i + 1) * seq_len + 1]``: its first ``seq_len`` tokens
    are the inputs and its last ``seq_len`` the labels, so consecutive windows share one token and
    every token but the first is a label exactly once.
    """

    def __init__(self, tokens: TokenStream, seq_len: int, split: str):
        if seq_len < 1:
            raise ConfigError("data.seq_len", seq_len, "an integer >= 1")
        if 0 < tokens.size <= seq_len:
            raise ConfigError(
                "data.seq_len",
                seq_len,
                f"at most {tokens.size - 1}",
                f"the {split} split has only {tokens.size} tokens, too few for one sequence",
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self._count = max(0, (tokens.size - 1) // seq_len)

    def __len__(self) -> int:
        return self._count

    def gather(self, indices: np.ndarray) -> np.ndarray:
        """Windows ``indices`` as an int64 array of shape ``[len(indices), seq_len + 1]``."""
        starts = np.asarray(indices, dtype=np.int64) * self.seq_len
        positions = starts[:, None] + np.arange(self.seq_len + 1)
        return self.tokens[positions].astype(np.int64)
