"""Choosing a backend by kind: the one switch between one device, torch.distributed and torch_xla."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from axtorch.parallel.backend import Backend
from axtorch.parallel.backend_kind import BackendKind
from axtorch.parallel.execution import ExecutionConfig
from axtorch.parallel.mesh import MeshConfig
from axtorch.parallel.pipeline_config import PipelineConfig
from axtorch.parallel.sharding import ShardingConfig
from axtorch.parallel.single import SingleDeviceBackend, device_name, resolve_device


def build_backend(
    kind: BackendKind,
    mesh: MeshConfig,
    sharding: ShardingConfig,
    device: str = "auto",
    pipeline: Optional[PipelineConfig] = None,
    gather_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    execution: Optional[ExecutionConfig] = None,
    layer_costs: Optional[Sequence[int]] = None,
) -> Backend:
    """The backend of ``kind``; ``device`` is the trainer's device setting (``auto``, ``cpu``, ``cuda:1``, ...).

    ``gather_dtype`` and ``reduce_dtype`` (None: the parameters' own) are the dtypes FSDP gathers
    parameters and reduces gradients in on the native backend (its mixed precision policy).
    ``execution`` (None: the defaults) holds the choices that only the xla backend reads today.
    ``layer_costs`` (one per decoder layer; None: equal) are what the native backend's pipeline
    stages balance.
    """
    if kind is BackendKind.native:
        from axtorch.parallel.native import NativeBackend  # torch.distributed only when asked for

        device_type = device_name(device).split(":")[0]
        return NativeBackend(mesh, sharding, device_type, pipeline, gather_dtype, reduce_dtype, layer_costs)
    if kind is BackendKind.xla:
        from axtorch.parallel.xla import XlaBackend  # torch_xla only when asked for

        return XlaBackend(mesh, sharding, execution or ExecutionConfig())
    return SingleDeviceBackend(resolve_device(device))
