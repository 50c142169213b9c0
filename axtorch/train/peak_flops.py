"""Datasheet peak FLOP/s per chip and dtype: the denominator of MFU.

A chip is recognised from the name its runtime reports (``torch.cuda.get_device_name``, torch_xla's
device kind, the EC2 instance type on Trainium). The figures are dense (no structured sparsity)
matrix-unit peaks per chip, from the vendors' datasheets. CPUs have no datasheet figure that
training can reach, so their peak is measured (``measure_matmul_peak_flops``). A chip not in the
table has no MFU: the trainer warns once and logs the other metrics.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from axtorch.train.flops import measure_matmul_peak_flops

TERA = 1e12


@dataclass(frozen=True)
class ChipPeak:
    #: Matched (case-insensitively, anywhere) against the runtime's device name.
    pattern: str
    chip: str
    bf16: float
    fp32: float

    def for_dtype(self, dtype: torch.dtype) -> float:
        return self.bf16 if dtype in (torch.bfloat16, torch.float16) else self.fp32


#: First match wins, so more specific names come first. fp32 is plain fp32 (TF32 off, PyTorch's
#: default for matmuls); on TPUs it is the bf16 figure, because XLA's default matmul precision
#: multiplies fp32 inputs in one bf16 pass.
DATASHEET_PEAKS: tuple[ChipPeak, ...] = (
    ChipPeak(r"\bB200\b", "NVIDIA B200", bf16=2250 * TERA, fp32=75 * TERA),
    ChipPeak(r"\bH200\b", "NVIDIA H200", bf16=989.4 * TERA, fp32=66.9 * TERA),
    ChipPeak(r"\bH100\b.*\bNVL\b", "NVIDIA H100 NVL", bf16=835 * TERA, fp32=60 * TERA),
    ChipPeak(r"\bH100\b.*\bPCIe\b", "NVIDIA H100 PCIe", bf16=756 * TERA, fp32=51.2 * TERA),
    ChipPeak(r"\bH100\b", "NVIDIA H100 SXM", bf16=989.4 * TERA, fp32=66.9 * TERA),
    ChipPeak(r"\bA100\b", "NVIDIA A100", bf16=312 * TERA, fp32=19.5 * TERA),
    ChipPeak(r"\bMI300X\b", "AMD Instinct MI300X", bf16=1307.4 * TERA, fp32=163.4 * TERA),
    ChipPeak(r"\bTPU v6 ?(lite|e)\b|\bv6e\b", "TPU v6e", bf16=918 * TERA, fp32=918 * TERA),
    ChipPeak(r"\bTPU v5 ?(lite|e)\b|\bv5(litepod|e)\b", "TPU v5e", bf16=197 * TERA, fp32=197 * TERA),
    ChipPeak(r"\bTPU v5p?$|\bTPU v5p\b|\bv5p\b", "TPU v5p", bf16=459 * TERA, fp32=459 * TERA),
    ChipPeak(r"\bTPU v4\b|\bv4\b", "TPU v4", bf16=275 * TERA, fp32=275 * TERA),
    ChipPeak(r"\btrn2\b|\bTrainium ?2\b", "AWS Trainium2", bf16=667 * TERA, fp32=181 * TERA),
    ChipPeak(r"\btrn1n?\b|\bTrainium ?1?\b", "AWS Trainium", bf16=190 * TERA, fp32=47.5 * TERA),
)


def find_chip(device_name: str) -> Optional[ChipPeak]:
    """The table entry for a runtime's device name, or None for a chip the table lacks."""
    for entry in DATASHEET_PEAKS:
        if re.search(entry.pattern, device_name, flags=re.IGNORECASE):
            return entry
    return None


def datasheet_peak_flops(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """Peak FLOP/s of one chip named ``device_name`` for matmuls in ``dtype``; None if unknown."""
    chip = find_chip(device_name)
    return chip.for_dtype(dtype) if chip is not None else None


def resolve_peak_flops(
    configured: Optional[float], device_name: str, dtype: torch.dtype, num_devices: int, devices_per_process: int
) -> Optional[float]:
    """Summed peak FLOP/s of the ``num_devices`` devices that run a step; None where none is known.

    ``configured`` (per device, ``trainer.peak_flops``) wins; a CPU's peak is measured and shared
    by the devices one process drives (XLA's virtual CPU devices); any other chip's comes from
    the table, and a chip the table lacks warns once.
    """
    per_device = configured
    if per_device is None and device_name == "cpu":
        per_device = measure_matmul_peak_flops(torch.device("cpu"), dtype) / devices_per_process
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
