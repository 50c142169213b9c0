"""Which text is held out for validation: one rule for every data source.

A document is held out when a seeded hash of its text falls below ``data.val_fraction``. The key
is the document's text, not its place in the corpus: a rank streaming its part of a corpus does
not know a document's global index, and two sources that hold the same documents (text files,
the shards ``axtorch-tokenize`` made of them, the same texts as JSONL lines) may number them
differently, but each reads the same text. So any two sources holding the same documents hold
out the same ones for the same ``data.seed``, and a duplicated document falls on one side only.

A corpus tokenized up front (``data=text_files``, ``jsonl``, ..., and ``axtorch-tokenize``) whose
held-out documents come to under a quarter or over twice ``val_fraction`` of its tokens (one long
document, a handful of files) is split by tokens instead: its last ``val_fraction`` of tokens, in
corpus order, are held out. A streamed corpus has no end to count back from and keeps the
document rule.
"""

from __future__ import annotations

import hashlib


def document_score(text: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by (seed, the document's text): BLAKE2b keyed by the seed."""
    digest = hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / 2**64


def is_held_out(text: str, fraction: float, seed: int) -> bool:
    """Whether the document with this text is held out: its score below ``fraction``."""
    return document_score(text, seed) < fraction


def needs_token_split(held_out_tokens: int, total_tokens: int, fraction: float) -> bool:
    """Whether held-out documents holding ``held_out_tokens`` of ``total_tokens`` are too far from
    ``fraction`` (under a quarter or over twice it), so that the corpus is split by tokens instead."""
    return not 0.25 * fraction * total_tokens <= held_out_tokens <= 2 * fraction * total_tokens


def token_split_size(total_tokens: int, fraction: float) -> int:
    """How many of the corpus's last tokens the token split holds out."""
    return round(total_tokens * fraction)
