"""Peak FLOP/s per device: the denominator of MFU.

A device is recognised from the name its runtime reports (``torch.cuda.get_device_name``, torch_xla's
device kind, the EC2 instance type on Trainium) and its peak read from the hardware catalogue
(``axtorch.parallel.chips``) for the precision the matmuls run in: per GPU or TPU chip, per
(logical) NeuronCore on Trainium, where each process or XLA device drives one. CPUs have no
datasheet figure that training can reach, so their peak is measured (``measure_matmul_peak_flops``).
A chip not in the catalogue has no MFU: the trainer warns once and logs the other metrics.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Iterator
from typing import Optional

import torch

from axtorch.host.cache import axtorch_cache
from axtorch.host.cpu import cpu_identity
from axtorch.parallel.hardware import runtime_device
from axtorch.train.flops import measure_matmul_peak_flops

#: The CPU matmul peaks measured on this machine, in axtorch's cache (``axtorch.host``), by CPU
#: model and features, torch version, dtype and thread count. Measuring keeps every core busy for
#: a quarter of a second (~0.8 CPU-seconds on this project's 2 cores): kept, it is paid once per
#: machine rather than by every process (each torchrun worker), and one machine's runs share one
#: MFU denominator. Delete the file to measure again.
PEAK_CACHE_FILE = "cpu_peak_flops.json"
#: The peaks this process has resolved, by the same key, so that a second trainer (a notebook, a
#: test run) reads no file.
_MEASURED_CPU_PEAKS: dict[str, float] = {}


def datasheet_peak_flops(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """Peak FLOP/s of one device named ``device_name`` for matmuls in ``dtype``; None if unknown."""
    device = runtime_device(device_name)
    return device.peak_flops(dtype) if device is not None else None


def resolve_peak_flops(
    configured: Optional[float], device_name: str, dtype: torch.dtype, num_devices: int, devices_per_process: int
) -> Optional[float]:
    """Summed peak FLOP/s of the ``num_devices`` devices that run a step; None where none is known.

    ``configured`` (per device, ``trainer.peak_flops``) wins; a CPU's peak is measured (once per
    machine, torch version, dtype and thread count: ``cpu_peak_flops``) and shared by the devices
    one process drives (XLA's virtual CPU devices); any other chip's comes from the catalogue, and
    a chip the catalogue lacks warns once.
    """
    per_device = configured
    if per_device is None and device_name == "cpu":
        per_device = cpu_peak_flops(dtype) / devices_per_process
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


def cpu_peak_flops(dtype: torch.dtype) -> float:
    """This machine's measured matmul peak in ``dtype`` at the current thread count: from this
    process, else from the cache file, else measured now and added to the file."""
    identity = hashlib.sha256(cpu_identity().encode()).hexdigest()[:16]
    key = f"{identity} torch-{torch.__version__} {dtype} threads-{torch.get_num_threads()}"
    if key not in _MEASURED_CPU_PEAKS:
        path = axtorch_cache() / PEAK_CACHE_FILE
        # One process at a time reads, measures and writes: torchrun's workers start together,
        # and each measuring beside the others would keep a peak of cores shared, while a
        # process that read the file before another wrote it would drop that one's entry.
        with _held_alone(path):
            kept = _read_peaks(path)
            if key not in kept:
                kept[key] = measure_matmul_peak_flops(torch.device("cpu"), dtype)
                _write_peaks(path, kept)
        _MEASURED_CPU_PEAKS[key] = kept[key]
    return _MEASURED_CPU_PEAKS[key]


@contextlib.contextmanager
def _held_alone(path: os.PathLike) -> Iterator[None]:
    """An exclusive lock on ``path``'s lock file while the block runs; none where it cannot be
    made (a read-only cache: nothing is written there either)."""
    with contextlib.ExitStack() as held:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            lock = held.enter_context(open(f"{os.fspath(path)}.lock", "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read_peaks(path: os.PathLike) -> dict[str, float]:
    """The file's peaks; none where it is missing, unreadable or not what this module writes."""
    try:
        with open(path) as handle:
            peaks = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(peaks, dict):
        return {}
    return {k: float(v) for k, v in peaks.items() if isinstance(v, (int, float)) and v > 0}


def _write_peaks(path: os.PathLike, peaks: dict[str, float]) -> None:
    """Replace the file whole (processes measuring at once each leave a complete file); a cache
    that cannot be written only means measuring again next time."""
    directory = os.path.dirname(path)
    with contextlib.suppress(OSError):
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as handle:
            json.dump(peaks, handle, indent=1, sort_keys=True)
        try:
            os.replace(handle.name, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(handle.name)  # left only where the replace failed
