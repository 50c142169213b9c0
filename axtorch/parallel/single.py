"""The ``single`` backend: one device, no sharding."""

from __future__ import annotations

import torch

from axtorch.config.errors import ConfigError


def resolve_device(name: str, key: str = "trainer.device") -> torch.device:
    """``auto`` picks CUDA when present, else the CPU; an unavailable device is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ConfigError(key, name, "auto, cpu, cuda or cuda:<index>", reason=str(error)) from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(key, name, "auto or cpu", reason="CUDA is not available on this machine")
    return device
