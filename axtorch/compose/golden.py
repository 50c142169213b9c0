"""Golden configs: every experiment's and model preset's fully resolved config, kept as text.

A changed default anywhere in the tree shows up as a diff in review, as AXLearn's golden configs
do. axtorch keeps snapshots of its own ``conf/`` (``tests/golden``); users keep snapshots of their
own config directories with the same tool: ``axtorch-golden action=check --config-dir ~/my_conf``.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from axtorch.compose.experiment_loader import CONFIG_MODULE, load_experiment_config
from axtorch.config.serialize import config_to_yaml

#: The groups snapshotted: each option's whole experiment, or (for model presets) the model alone.
SNAPSHOT_GROUPS = ("experiment", "model")


def group_options(group: str, config_dirs: Sequence[str | Path] = ()) -> list[str]:
    """Options of ``group``: those in ``config_dirs`` if any are given, else axtorch's own."""
    if config_dirs:
        folders = [Path(d).expanduser() / group for d in config_dirs]
        return sorted({p.stem for folder in folders if folder.is_dir() for p in folder.glob("*.yaml")})
    folder = importlib.resources.files(CONFIG_MODULE) / group
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def snapshot(group: str, option: str, config_dirs: Sequence[str | Path] = ()) -> str:
    """The resolved YAML of one option: the experiment it selects, or the model preset alone."""
    config = load_experiment_config([f"{group}={option}"], config_dirs)
    return config_to_yaml(config.model if group == "model" else config)


def snapshots(config_dirs: Sequence[str | Path] = ()) -> dict[str, str]:
    """``{"<group>/<option>.yaml": resolved YAML}`` for every snapshotted option."""
    return {
        f"{group}/{option}.yaml": snapshot(group, option, config_dirs)
        for group in SNAPSHOT_GROUPS
        for option in group_options(group, config_dirs)
    }


@dataclass
class GoldenDiff:
    changed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    #: Golden files whose experiment or preset no longer exists.
    stale: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.changed or self.missing or self.stale)


def compare_golden(golden_dir: Path, current: dict[str, str]) -> GoldenDiff:
    diff = GoldenDiff()
    for name, text in current.items():
        path = golden_dir / name
        if not path.is_file():
            diff.missing.append(name)
        elif path.read_text() != text:
            diff.changed.append(name)
    existing = {
        str(p.relative_to(golden_dir)) for group in SNAPSHOT_GROUPS for p in (golden_dir / group).glob("*.yaml")
    }
    diff.stale = sorted(existing - set(current))
    return diff


def write_golden(golden_dir: Path, current: dict[str, str]) -> None:
    """Write every snapshot and delete golden files of options that no longer exist."""
    for name in compare_golden(golden_dir, current).stale:
        (golden_dir / name).unlink()
    for name, text in current.items():
        path = golden_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
