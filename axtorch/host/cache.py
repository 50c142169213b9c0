"""axtorch's per-user cache (``$XDG_CACHE_HOME/axtorch``, ``~/.cache/axtorch`` by default): what a
machine builds or measures once and keeps, keyed by ``axtorch.host.cpu``'s identity so that a home
directory shared by different machines holds one of each for each."""

from __future__ import annotations

import os
from pathlib import Path


def axtorch_cache() -> Path:
    """axtorch's per-user cache directory (not created here)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "axtorch"
