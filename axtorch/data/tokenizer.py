"""A thin wrapper over Hugging Face ``tokenizers``: load a ``tokenizer.json`` or train a byte-level BPE.

Training is cached per corpus so a second run with the same data starts at once, and the trained
file is what the trainer copies into the run directory for generation and export.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from axtorch.config.errors import ConfigError
from axtorch.data.sources import DocumentSource, stable_hash, write_file_atomically

TOKENIZER_FILE = "tokenizer.json"
#: Beside a tokenizer.json: its special tokens and chat template, as HF writes them.
TOKENIZER_SETTINGS_FILE = "tokenizer_config.json"


@dataclass
class TokenizerConfig:
    """Either a ``tokenizer.json`` to load (``path``) or the settings for training one on the corpus."""

    path: Optional[str] = None
    vocab_size: int = 8192
    train_max_bytes: int = 8_000_000
    eos_token: str = "<|endoftext|>"


class Tokenizer:
    """Text <-> token ids, with the end-of-sequence id that separates packed documents."""

    def __init__(self, inner: tokenizers.Tokenizer, eos_token: str, settings: Optional[dict[str, Any]] = None):
        eos_id = inner.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(
                f"tokenizer has no token {eos_token!r}; set data.tokenizer.eos_token to its end-of-text token"
            )
        self._inner = inner
        self._eos_id = eos_id
        self.eos_token = eos_token
        #: The ``tokenizer_config.json`` beside the loaded file (special tokens, chat template), or {}.
        self.settings: dict[str, Any] = settings or {}

    @classmethod
    def load(cls, path: str | os.PathLike[str], eos_token: str) -> Tokenizer:
        settings_file = Path(path).parent / TOKENIZER_SETTINGS_FILE
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        return cls(tokenizers.Tokenizer.from_file(str(path)), eos_token, settings)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically, so a crash never leaves a half-written file that a later run would load."""
        serialized = self._inner.to_str(pretty=True).encode("utf-8")
        write_file_atomically(Path(path), lambda file: file.write(serialized))

    def description(self) -> dict[str, Any]:
        """The ``tokenizers`` JSON description: model, vocabulary, merges, pre-tokenizer, added tokens."""
        return json.loads(self._inner.to_str())

    # Special tokens are never added: packing appends EOS itself, and decode is the exact inverse.
    def encode(self, text: str) -> list[int]:
        return self._inner.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._inner.encode_batch(texts, add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids and each token's character span in ``text``."""
        encoding = self._inner.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Iterable[int]) -> str:
        return self._inner.decode(list(ids), skip_special_tokens=False)

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, including special tokens: the embedding table size a model needs."""
        return self._inner.get_vocab_size(with_added_tokens=True)


def validate_tokenizer_config(cfg: TokenizerConfig) -> None:
    """Reject settings that cannot work, before any file is read."""
    if cfg.path is not None and not Path(cfg.path).expanduser().is_file():
        raise ConfigError("data.tokenizer.path", cfg.path, "null (train one) or an existing tokenizer.json")
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if cfg.path is None and cfg.vocab_size <= minimum:
        raise ConfigError(
            "data.tokenizer.vocab_size",
            cfg.vocab_size,
            f"an integer > {minimum}",
            "a byte-level BPE needs 256 byte tokens plus the EOS token before any merge",
        )
    if cfg.train_max_bytes < 1:
        raise ConfigError("data.tokenizer.train_max_bytes", cfg.train_max_bytes, "an integer >= 1")
    if not cfg.eos_token:
        raise ConfigError("data.tokenizer.eos_token", cfg.eos_token, "a non-empty string")


def tokenizer_fingerprint(cfg: TokenizerConfig) -> str:
    """Identifies the tokenizer ``cfg`` yields for a given corpus: file content, or training settings."""
    if cfg.path is not None:
        content = hashlib.sha256(Path(cfg.path).expanduser().read_bytes()).hexdigest()
        return stable_hash("file", content, cfg.eos_token)
    return stable_hash("bpe", cfg.vocab_size, cfg.train_max_bytes, cfg.eos_token)


def _leading_text(documents: Iterator[str], max_bytes: int) -> Iterator[str]:
    """The first documents, truncated so that at most ``max_bytes`` UTF-8 bytes are yielded."""
    remaining = max_bytes
    for document in documents:
        encoded = document.encode("utf-8")
        if len(encoded) >= remaining:
            yield encoded[:remaining].decode("utf-8", errors="ignore")
            return
        remaining -= len(encoded)
        yield document


def train_byte_level_bpe(texts: Iterator[str], vocab_size: int, eos_token: str) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE: every byte is in the alphabet, so no text is unknown."""
    inner = tokenizers.Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(inner, eos_token)


def load_or_train_tokenizer(cfg: TokenizerConfig, source: DocumentSource, cache_dir: Path) -> Tokenizer:
    """Load ``cfg.path``, else the tokenizer cached in ``cache_dir``, else train one and cache it.

    ``cache_dir / "tokenizer.json"`` always exists afterwards (a loaded file is copied there), so
    the cache holds the exact tokenizer its token arrays were made with.
    """
    validate_tokenizer_config(cfg)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = cache_dir / TOKENIZER_FILE
    if cfg.path is not None:
        tokenizer = Tokenizer.load(Path(cfg.path).expanduser(), cfg.eos_token)
        if not cached.exists():
            tokenizer.save(cached)
        return tokenizer
    if cached.exists():
        return Tokenizer.load(cached, cfg.eos_token)
    texts = _leading_text(source.iter_documents(), cfg.train_max_bytes)
    tokenizer = train_byte_level_bpe(texts, cfg.vocab_size, cfg.eos_token)
    tokenizer.save(cached)
    return tokenizer
