"""Helpers for the tests that run training in separate processes and interrupt them."""

from __future__ import annotations

import json
from pathlib import Path


def logged_steps(run_dir: Path) -> int:
    """The last step whose training metrics a run (or one of its attempts) has written."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.endswith("}") and "train/loss" in line), default=0)
