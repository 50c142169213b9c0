"""File helpers the data pipeline's caches share: content keys and writes that are never torn."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def stable_hash(*parts: Any) -> str:
    """A short hex digest of JSON-able parts, identical across processes and Python versions."""
    payload = json.dumps(parts, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(payload).hexdigest()[:16]


def write_file_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through a temporary file and rename it, so ``path`` is either absent or complete.

    A run killed mid-write must not leave a truncated cache file that the next run would trust.
    """
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
