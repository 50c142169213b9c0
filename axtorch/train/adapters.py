"""Training adapters on a frozen base (``model/adapter``): where the base comes from, and its record.

A checkpoint of such a run holds only the adapters (``checkpoint.trained_state``); the base is
rebuilt at every resume, export and generation from where it first came from: the imported
weights (``init_from``) or the seeded initialisation. ``base_digest`` names that source (the
SHA-256 of the imported files, or the seed), the trainer state records it, and a resume or an
export refuses a base that is no longer the one the adapters were trained on.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.init import initial_parameter_values
from axtorch.models.adapter import adapters
from axtorch.train.experiment import ExperimentConfig

#: The trainer state's key for ``base_digest``.
BASE_DIGEST_KEY = "adapter_base_digest"
_CHUNK = 1 << 24


def base_digest(config: ExperimentConfig) -> Optional[str]:
    """What the frozen base is: ``sha256:<hex>`` of ``init_from``'s files, or ``seed:<n>``; None without adapters."""
    if config.model.adapter is None:
        return None
    if not config.init_from:
        return f"seed:{config.trainer.seed}"
    kind, _, location = config.init_from.partition(":")
    path = Path(location).expanduser()
    files = [path] if kind == "gguf" else sorted([*path.glob("*.safetensors"), path / "config.json"])
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as stream:
            while chunk := stream.read(_CHUNK):
                digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def check_base(state: dict[str, Any], expected: Optional[str], checkpoint: Path) -> None:
    """Refuse a checkpoint whose adapters were trained on another base than ``expected``."""
    recorded = state.get(BASE_DIGEST_KEY)
    if recorded != expected:
        raise ConfigError(
            "init_from" if expected and expected.startswith("sha256:") else "trainer.seed",
            expected,
            f"the base that checkpoint {checkpoint}'s adapters were trained on ({recorded})",
            reason="the adapters only make sense on their own frozen base",
        )


def with_fresh_adapters(
    base_values: Iterable[tuple[str, torch.Tensor]], model: nn.Module
) -> Iterable[tuple[str, torch.Tensor]]:
    """``base_values``, then freshly drawn values for every adapter of ``model`` (nothing else without adapters).

    The adapters are drawn after the base, from the global generator, whatever the base came
    from: an imported model gets the same fresh adapters as a seeded one.
    """
    found = adapters(model)
    return itertools.chain(base_values, _adapter_values(found)) if found else base_values


def _adapter_values(found: list[tuple[str, nn.Module]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, adapter in found:
        for parameter_name, value in initial_parameter_values(adapter):
            yield f"{name}.{parameter_name}", value
