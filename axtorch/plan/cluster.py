"""The cluster a hardware id names, as the mesh search sees it: its devices and their links."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from axtorch.config.errors import ConfigError
from axtorch.parallel.chips import CHIPS, GIB, Device, device_of_hardware_id
from axtorch.parallel.hardware import device_count
from axtorch.parallel.mesh import MESH_AXES


@dataclass(frozen=True)
class Cluster:
    hardware: str
    devices: int
    #: What one process (native) or XLA device drives: a GPU, a TPU chip, a logical NeuronCore.
    device: Device
    #: Bytes per device: the catalogue's, or the ``device_memory=`` the user gave.
    memory_bytes: float

    @property
    def backend(self) -> str:
        """The backend that runs there: xla on TPUs and Trainium (no pipeline stages), native elsewhere."""
        return self.device.chip.backend

    def bandwidth(self, mesh: dict[str, int], axis: str) -> float:
        """Bytes/s per device on the link an axis's collectives cross: the fast links when its
        devices (that axis and those inside it) lie within one fast domain, else the network."""
        inner = math.prod(mesh[a] for a in MESH_AXES[MESH_AXES.index(axis) :])
        fast_domain = self.device.fast_domain or self.devices
        return self.device.fast_bandwidth if inner <= fast_domain else self.device.network_bandwidth


def cluster_for(hardware: str, device_memory_gib: Optional[float] = None) -> Cluster:
    """The cluster a hardware id names (``gpu-H100-8x32``, ``tpu-v5p-512``, ``trn2-64x4``)."""
    devices = device_count(hardware)
    device = device_of_hardware_id(hardware)
    if devices is None or device is None:
        known = ", ".join(chip.id_name for chip in CHIPS if chip.id_name)
        raise ConfigError("hardware", hardware, f"an id such as gpu-H100-8x32 or tpu-v5p-512, of a chip in ({known})")
    memory = device_memory_gib * GIB if device_memory_gib is not None else device.memory_bytes
    return Cluster(hardware, devices, device, memory)
