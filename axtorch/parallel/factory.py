"""Choosing the backend named by ``TrainConfig.backend``."""

from __future__ import annotations

import torch

from axtorch.config.schema import Backend as BackendName
from axtorch.config.schema import TrainConfig
from axtorch.parallel.backend import Backend
from axtorch.parallel.single import SingleDeviceBackend, resolve_device


def native_device_type(device: str) -> str:
    """The torch device type a native run uses: ``auto`` means CUDA when present."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.split(":")[0]


def build_backend(config: TrainConfig) -> Backend:
    if config.backend is BackendName.native:
        from axtorch.parallel.native import NativeBackend  # torch.distributed only when asked for

        return NativeBackend(config.mesh, config.sharding, native_device_type(config.trainer.device))
    if config.backend is BackendName.xla:
        from axtorch.parallel.xla import XlaBackend  # torch_xla only when asked for

        return XlaBackend(config.mesh, config.sharding)
    return SingleDeviceBackend(resolve_device(config.trainer.device))
