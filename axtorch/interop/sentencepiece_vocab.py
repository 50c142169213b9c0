"""A SentencePiece BPE vocabulary (pieces, scores, token types) as a ``tokenizers`` tokenizer.

GGUF files of Llama 2, Mistral and Phi-3 (``tokenizer.ggml.model == "llama"``) carry their
SentencePiece vocabulary as pieces with scores, not as merges. SentencePiece's BPE joins, at
each step, the adjacent pair whose joined piece scores highest; a ``tokenizers`` BPE whose merges
are every (left, right) split of every piece, ranked by the joined piece's score, takes the same
steps. Text becomes pieces with spaces as ``▁`` (and one prepended, as SentencePiece's dummy
prefix), characters outside the vocabulary fall back to their UTF-8 bytes (``<0x41>`` pieces),
and decoding reverses both. User-defined pieces are matched whole, as SentencePiece does.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# GGUF token types (gguf.TokenType), as llama.cpp's converters write them.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def sentencepiece_bpe(
    pieces: Sequence[str], scores: Sequence[float], types: Sequence[int], add_space_prefix: bool = True
) -> tokenizers.Tokenizer:
    """The ``tokenizers`` equivalent of a SentencePiece BPE model with byte fallback."""
    vocab = {piece: index for index, piece in enumerate(pieces)}
    mergeable = [index for index, kind in enumerate(types) if kind in (NORMAL, USER_DEFINED) and len(pieces[index]) > 1]
    ranked = []
    for index in mergeable:
        piece = pieces[index]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unknown = next((pieces[i] for i, kind in enumerate(types) if kind == UNKNOWN), None)
    inner = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unknown, fuse_unk=True, byte_fallback=True))
    prefix = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    inner.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", SPACE)])
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    inner.decoder = decoders.Sequence(decode)
    inner.add_special_tokens(
        [AddedToken(pieces[i], special=True, normalized=False) for i, kind in enumerate(types) if kind == CONTROL]
    )
    # SentencePiece matches user-defined pieces whole, longest first, wherever they occur in the
    # text (Gemma's runs of spaces and newlines, its HTML tags), before BPE sees the rest.
    inner.add_tokens([AddedToken(pieces[i], normalized=False) for i, kind in enumerate(types) if kind == USER_DEFINED])
    return inner
