"""The ``single`` backend: one device, no sharding."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.models.causal_lm import CausalLM
from axtorch.parallel.backend import HostFedBackend


def device_name(name: str) -> str:
    """The one reading of a ``device`` setting: ``auto`` is CUDA when present, else the CPU; others stay."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_device(name: str, key: str = "trainer.device") -> torch.device:
    """The device a ``device`` setting names (:func:`device_name`); an unavailable device is a ConfigError."""
    try:
        device = torch.device(device_name(name))
    except RuntimeError as error:
        raise ConfigError(key, name, "auto, cpu, cuda or cuda:<index>", reason=str(error)) from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(key, name, "auto or cpu", reason="CUDA is not available on this machine")
    return device


class SingleDeviceBackend(HostFedBackend):
    rank = 0
    world_size = 1
    data_parallel_rank = 0
    data_parallel_size = 1
    is_main_process = True
    gradient_divisor = 1

    def __init__(self, device: torch.device):
        self.device = device

    def parallelize(self, model: CausalLM) -> CausalLM:
        return model.to_empty(device=self.device)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: Optional[float]) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm is not None else math.inf)

    def barrier(self) -> None:
        pass

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def close(self) -> None:
        pass
