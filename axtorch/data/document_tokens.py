"""Per-token flags that travel with token ids through packing: document starts and loss targets.

A packed stream is an int64 array of token ids (below 2**32) with two flag bits above them, so
that windows, stream carries and resume states need no parallel arrays:

- ``NOT_TARGET``: no loss is taken on predicting this token (a chat's system and user turns);
- ``DOCUMENT_START``: the first token of a document (document masking, ``data.document_masking``).

``batches.to_batch`` reads them: labels of untargeted tokens are ignored, and with document
masking every row gets segment ids, positions that restart at 0 in each document, and no label
that crosses into the next document.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

#: Set on a token that is no loss target.
NOT_TARGET = 1 << 32
#: Set on the first token of a document.
DOCUMENT_START = 1 << 33
#: The token id below the flags.
TOKEN_ID = (1 << 32) - 1


def flag_document(ids: list[int], targets: Optional[np.ndarray] = None, mark_start: bool = True) -> np.ndarray:
    """One document's int64 tokens: ``ids``, ``NOT_TARGET`` where ``targets`` (bool) is False, and
    ``DOCUMENT_START`` on the first when ``mark_start``."""
    tokens = np.array(ids, dtype=np.int64)
    if targets is not None:
        tokens[~targets] |= NOT_TARGET
    if mark_start and tokens.size:
        tokens[0] |= DOCUMENT_START
    return tokens


def mark_starts_after(windows: np.ndarray, separator: int) -> np.ndarray:
    """``windows`` [N, S + 1] of plain ids with ``DOCUMENT_START`` on every token that follows ``separator``.

    For streams cached without flags (``packing.py``'s token arrays), where each document ends
    with the end-of-sequence token.
    """
    flagged = windows.astype(np.int64, copy=True)
    flagged[:, 1:][windows[:, :-1] == separator] |= DOCUMENT_START
    return flagged
