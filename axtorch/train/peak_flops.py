"""Peak FLOP/s per device: the denominator of MFU.

A device is recognised from the name its runtime reports (``torch.cuda.get_device_name``, torch_xla's
device kind, the EC2 instance type on Trainium) and its peak read from the hardware catalogue
(``axtorch.parallel.chips``) for the precision the matmuls run in: per GPU or TPU chip, per
(logical) NeuronCore on Trainium, where each process or XLA device drives one. CPUs have no
datasheet figure that training can reach, so their peak is measured (``measure_matmul_peak_flops``).
A chip not in the catalogue has no MFU: the trainer warns once and logs the other metrics.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from axtorch.parallel.hardware import runtime_device
from axtorch.train.flops import measure_matmul_peak_flops

#: The CPU matmul peak measured in this process, per dtype and thread count (~0.6 s each time on
#: this project's CPU), so that a second trainer in the same process (a notebook, a test run)
#: reuses it.
_MEASURED_CPU_PEAKS: dict[tuple[torch.dtype, int], float] = {}


def datasheet_peak_flops(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """Peak FLOP/s of one device named ``device_name`` for matmuls in ``dtype``; None if unknown."""
    device = runtime_device(device_name)
    return device.peak_flops(dtype) if device is not None else None


def resolve_peak_flops(
    configured: Optional[float], device_name: str, dtype: torch.dtype, num_devices: int, devices_per_process: int
) -> Optional[float]:
    """Summed peak FLOP/s of the ``num_devices`` devices that run a step; None where none is known.

    ``configured`` (per device, ``trainer.peak_flops``) wins; a CPU's peak is measured (once per
    process, dtype and thread count) and shared by the devices one process drives (XLA's virtual
    CPU devices); any other chip's comes from the catalogue, and a chip the catalogue lacks warns
    once.
    """
    per_device = configured
    if per_device is None and device_name == "cpu":
        key = (dtype, torch.get_num_threads())
        if key not in _MEASURED_CPU_PEAKS:
            _MEASURED_CPU_PEAKS[key] = measure_matmul_peak_flops(torch.device("cpu"), dtype)
        per_device = _MEASURED_CPU_PEAKS[key] / devices_per_process
    elif per_device is None:
        per_device = datasheet_peak_flops(device_name, dtype)
        if per_device is None:
            warnings.warn(
                f"no datasheet peak FLOP/s for device {device_name!r} in {dtype}, so train/mfu is "
                "not logged; set trainer.peak_flops=<FLOP/s per device> to log it",
                RuntimeWarning,
                stacklevel=2,
            )
    return None if per_device is None else per_device * num_devices
