"""The debug experiment, quiet: the overrides every training test starts from (one place for them)."""

from __future__ import annotations

from pathlib import Path


def quiet_debug_run(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    """Overrides for the debug experiment writing into ``run_dir``, without progress bar or plot."""
    return [
        "experiment=debug",
        f"run_dir={run_dir}",
        f"data.cache_dir={cache}",
        "trainer.progress_bar=false",
        "trainer.plot=false",
        *extra,
    ]
