"""The hardware id that mesh rules match: accelerator kind and chip, devices per host, hosts.

Ids read ``gpu-H100-8x32`` (8 GPUs a host, 32 hosts), ``tpu-v5e-256`` (the TPU slice's own
accelerator type, which counts its TensorCores), ``trn2-64x4`` (NeuronCores a host, hosts: a
trn2.48xlarge's 16 chips expose 64 logical NeuronCores at the default LNC=2; ``trn2-lnc1-128x4``
at LNC=1; ``trn1-32x4`` for trn1.32xlarge's 16 chips of 2) and ``cpu-2x1`` (cores, hosts). A
device is what one process (native) or one XLA device drives: ``chips.py`` says how many a chip
exposes. Nothing here imports a backend: it reads torch's CUDA queries, the
environment that TPU VMs, torchrun and Slurm set, and the EC2 instance type. The TPU and
Trainium branches follow those platforms' documented environment and are untested here.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from axtorch.parallel.backend import ec2_instance_type
from axtorch.parallel.chips import Device, chip_named, device_of_hardware_id

#: TPU accelerator-type prefixes (``TPU_ACCELERATOR_TYPE``) -> the generation's usual name.
_TPU_GENERATIONS = {"v5litepod": "v5e", "v5lite": "v5e", "v6e": "v6e", "v5p": "v5p", "v4": "v4"}
#: Trainium chips per host by EC2 instance type.
_TRAINIUM_CHIPS = {
    "trn1.2xlarge": 1,
    "trn1.32xlarge": 16,
    "trn1n.32xlarge": 16,
    "trn2.48xlarge": 16,
    "trn2u.48xlarge": 16,
}


def host_count() -> int:
    """Hosts in this job: from torchrun (WORLD_SIZE / LOCAL_WORLD_SIZE), Slurm, or 1."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world and local and int(local) > 0:
        return max(1, int(world) // int(local))
    if nodes := os.environ.get("SLURM_NNODES") or os.environ.get("SLURM_JOB_NUM_NODES"):
        return int(nodes)
    return 1


def detect_hardware_id() -> str:
    """This job's hardware id (module docstring), from the first kind of accelerator found."""
    if accelerator := os.environ.get("TPU_ACCELERATOR_TYPE"):  # set on Cloud TPU VMs, e.g. v5litepod-256
        generation, _, size = accelerator.partition("-")
        return f"tpu-{_TPU_GENERATIONS.get(generation, generation)}-{size}"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        chip = re.search(r"\b([A-Z]+\d{2,4}[A-Z]*)\b", name.replace("NVIDIA ", ""))
        return f"gpu-{chip.group(1) if chip else 'unknown'}-{torch.cuda.device_count()}x{host_count()}"
    instance = ec2_instance_type() or ""
    device = runtime_device(instance) if instance.startswith("trn") else None
    if device is not None:
        lnc = "" if device.cores == device.chip.cores_per_device[0] else f"-lnc{device.cores}"
        per_host = _TRAINIUM_CHIPS.get(instance, 0) * device.per_chip
        return f"{instance.split('.')[0]}{lnc}-{per_host}x{host_count()}"
    return f"cpu-{os.cpu_count() or 1}x{host_count()}"


def runtime_device(device_name: str) -> Optional[Device]:
    """The catalogue's device for a runtime's device name, grouped as this process's runtime is set
    (Trainium's ``NEURON_LOGICAL_NC_CONFIG``); None for a chip the catalogue lacks."""
    chip = chip_named(device_name)
    if chip is None:
        return None
    configured = os.environ.get(chip.cores_variable) if chip.cores_variable else None
    return chip.device(int(configured) if configured else None, key=str(chip.cores_variable))


def device_count(hardware_id: str) -> Optional[int]:
    """How many devices a hardware id stands for (``gpu-H100-8x4``: 32); None for an id of another form.

    A TPU accelerator type counts TensorCores: a v4 or v5p chip's two make one device.
    """
    if match := re.fullmatch(r"tpu-(\w+)-(\d+)", hardware_id):
        device = device_of_hardware_id(hardware_id)
        return int(match.group(2)) // (device.cores if device is not None else 1)
    if match := re.fullmatch(r"[\w-]+?-(\d+)x(\d+)", hardware_id):
        return int(match.group(1)) * int(match.group(2))
    return None
