"""The tokenizer of a corpus: the file the config names, else the one cached for it, else one trained on it.

Training is cached per corpus so a second run with the same data starts at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from axtorch.data.sources import DocumentSource
from axtorch.data.tokenizer import (
    DEFAULT_EOS_TOKEN,
    TOKENIZER_FILE,
    Tokenizer,
    TokenizerConfig,
    train_byte_level_bpe,
    validate_tokenizer_config,
)


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
    tokenizer = train_byte_level_bpe(texts, cfg.vocab_size, cfg.eos_token or DEFAULT_EOS_TOKEN)
    tokenizer.save(cached)
    return tokenizer
