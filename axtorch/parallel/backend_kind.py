"""The backend kinds, apart from the factory that builds them, so that a config can name one cheaply."""

from __future__ import annotations

import enum


class BackendKind(enum.Enum):
    #: One device (CPU or one CUDA GPU), no sharding.
    single = "single"
    #: torch.distributed under torchrun: FSDP2 and DTensor tensor parallelism over the mesh.
    native = "native"
    #: torch_xla SPMD: TPU, torch-neuronx, or CPU virtual devices.
    xla = "xla"
