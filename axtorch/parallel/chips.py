"""The hardware catalogue: each accelerator's published figures, and the devices a chip exposes.

One table read by the trainer's MFU (``axtorch.train.peak_flops``), the hardware ids that mesh
rules match (``hardware.py``) and the planner (``axtorch.plan``). Figures are per chip, from the
vendors' datasheets, rounded: dense matmul peaks (no structured sparsity), memory, and one
direction of the fast links and of the network between hosts. A framework's device is a share of
a chip (``Device``): a GPU or TPU chip is one device, a Trainium chip several NeuronCores.

Trainium, from the AWS Neuron documentation (awsdocs-neuron.readthedocs-hosted.com):
- trn1 (``arch/neuron-hardware/trainium``, ``trn1-arch``): a Trainium chip is 2 NeuronCore-v2
  with 190 BF16/FP16/cFP8/TF32 and 47.5 FP32 TFLOP/s and 32 GiB; NeuronLink-v2 384 GiB/s per
  chip; trn1.32xlarge has 16 chips and 800 Gbps of EFA. Logical NeuronCore configurations other
  than 1 are refused on trn1 (compiler error NCC_EARG001).
- trn2 (``trainium2``, ``trn2-arch``, ``training/best-practices``): a Trainium2 chip is 8 physical
  NeuronCore-v3 with 667 BF16/FP16/TF32, 181 FP32 and 1,299 FP8 TFLOP/s and 96 GiB; NeuronLink-v3
  1.28 TB/s per chip; trn2.48xlarge has 16 chips in a 4x4 torus and 3.2 Tbps of EFA. The runtime
  groups physical cores into logical NeuronCores (``NEURON_LOGICAL_NC_CONFIG``, LNC): the default
  LNC=2 exposes 4 per chip (64 ranks per instance, about 24 GiB each), LNC=1 all 8.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import torch

from axtorch.config.errors import ConfigError

TERA = 1e12
GB = 1e9
GIB = 1024**3


@dataclass(frozen=True)
class Chip:
    """One accelerator's published figures, per chip."""

    name: str
    #: Matched (case-insensitively, anywhere) against the name the runtime reports:
    #: ``torch.cuda.get_device_name``, torch_xla's device kind, the EC2 instance type on Trainium.
    runtime_name: str
    #: Matched against a hardware id's accelerator (``H100`` in ``gpu-H100-8x32``, ``v5p`` in
    #: ``tpu-v5p-512``, ``trn2`` in ``trn2-64x4``); empty: a variant no hardware id names.
    id_name: str
    #: Dense matmul peak FLOP/s of the chip for fp32 inputs (TF32 off, PyTorch's default; on TPUs
    #: the bf16 figure, as XLA's default precision multiplies fp32 in one bf16 pass), bf16 and fp8.
    fp32: float
    bf16: float
    fp8: Optional[float]
    memory_gib: float
    #: Chips joined by the fast links: a GPU host's NVLink domain, a Trainium instance; None: a
    #: TPU slice, all fast.
    fast_domain: Optional[int]
    #: Per-chip bandwidth, GB/s, one direction: within the fast domain, and between hosts.
    fast_gbs: float
    network_gbs: float
    #: The backend axtorch runs there: ``xla`` (TPU; Trainium through torch-neuronx) or ``native``.
    backend: str
    #: Physical cores per chip: a TPU's TensorCores, a Trainium chip's NeuronCores.
    cores: int = 1
    #: The physical cores one device may group, the runtime's default first: Trainium2's logical
    #: NeuronCore configuration (LNC), a TPU v4/v5p megacore (both TensorCores, one device).
    cores_per_device: tuple[int, ...] = (1,)
    #: The environment variable that sets ``cores_per_device`` at run time, if any.
    cores_variable: Optional[str] = None
    #: What the vendor calls a core.
    core_name: str = "core"
    #: A TPU generation's name in the TPU compiler's topologies (``v5p`` in ``v5p:4x4x4``); None elsewhere.
    topology_generation: Optional[str] = None
    #: The slice shapes the compiler is asked for, smallest first (2-D tori for v5e/v6e, 3-D for v4/v5p).
    slice_shapes: tuple[tuple[int, ...], ...] = ()
    #: HBM bandwidth per chip, GB/s: what prices the compiler's bytes accessed (TPUs; None elsewhere).
    hbm_gbs: Optional[float] = None

    def peak_flops(self, dtype: torch.dtype) -> float:
        """The chip's peak FLOP/s for matmuls in ``dtype`` (fp8 falls back to bf16 where it has none)."""
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return self.fp8 or self.bf16
        return self.bf16 if dtype in (torch.bfloat16, torch.float16) else self.fp32

    def device(self, cores: Optional[int] = None, key: str = "hardware") -> Device:
        """The device this chip exposes when each groups ``cores`` physical cores (default: the runtime's)."""
        cores = self.cores_per_device[0] if cores is None else cores
        if cores not in self.cores_per_device:
            raise ConfigError(key, cores, f"cores per device of {self.name}: one of {list(self.cores_per_device)}")
        return Device(self, cores)


@dataclass(frozen=True)
class Device:
    """What a framework sees as one device (a GPU, a TPU chip, a logical NeuronCore): its chip's share."""

    chip: Chip
    #: Physical cores it groups.
    cores: int

    @property
    def per_chip(self) -> int:
        return self.chip.cores // self.cores

    def peak_flops(self, dtype: torch.dtype) -> float:
        return self.chip.peak_flops(dtype) / self.per_chip

    @property
    def memory_bytes(self) -> float:
        return self.chip.memory_gib * GIB / self.per_chip

    @property
    def fast_domain(self) -> Optional[int]:
        """Devices joined by the fast links; None: all of them."""
        return None if self.chip.fast_domain is None else self.chip.fast_domain * self.per_chip

    @property
    def fast_bandwidth(self) -> float:
        """Bytes/s one device sends over the fast links while its chip's other devices send too."""
        return self.chip.fast_gbs * GB / self.per_chip

    @property
    def network_bandwidth(self) -> float:
        return self.chip.network_gbs * GB / self.per_chip

    def describe(self) -> str:
        """``AWS Trainium2 NeuronCore, 4 per chip (NEURON_LOGICAL_NC_CONFIG=2)``, or the chip when it is one device."""
        chip = self.chip
        if self.per_chip == 1:
            return chip.name
        return f"{chip.name} {chip.core_name}, {self.per_chip} per chip ({chip.cores_variable}={self.cores})"


def _gpu(
    name: str,
    runtime_name: str,
    id_name: str,
    tflops: tuple[float, float, Optional[float]],
    memory_gib: float,
    nvlink: float,
    network: float,
) -> Chip:
    """A GPU: one device, eight to an NVLink domain (a host); ``tflops`` are (fp32, bf16, fp8)."""
    fp32, bf16, fp8 = tflops
    fp8_flops = None if fp8 is None else fp8 * TERA
    return Chip(
        name, runtime_name, id_name, fp32 * TERA, bf16 * TERA, fp8_flops, memory_gib, 8, nvlink, network, "native"
    )


#: Google's slice shapes (chips along each torus axis): v5e and v6e are 2-D, v4 and v5p 3-D.
_SLICES_2D = ((2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16))
_SLICES_3D = (
    (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4), (4, 4, 8), (4, 8, 8), (8, 8, 8), (8, 8, 16), (8, 16, 16),
)  # fmt: skip


def _tpu(
    name: str,
    runtime_name: str,
    id_name: str,
    tflops: float,
    memory_gib: float,
    ici: float,
    cores: int,
    generation: str,
    hbm: float,
) -> Chip:
    """A TPU chip: one device (a v4/v5p megacore is both TensorCores), fp32 at the bf16 rate, a slice all ICI."""
    flops = tflops * TERA
    shapes = _SLICES_3D if cores == 2 else _SLICES_2D
    return Chip(
        name, runtime_name, id_name, flops, flops, None, memory_gib, None, ici, 25, "xla", cores, (cores,),
        topology_generation=generation, slice_shapes=shapes, hbm_gbs=hbm,
    )  # fmt: skip


#: First match wins, so more specific names come first.
CHIPS: tuple[Chip, ...] = (
    _gpu("NVIDIA B200", r"\bB200\b", "B200", (75, 2250, 4500), 180, nvlink=900, network=50),
    _gpu("NVIDIA H200", r"\bH200\b", "H200", (66.9, 989.4, 1978.9), 141, nvlink=450, network=50),
    _gpu("NVIDIA H100 NVL", r"\bH100\b.*\bNVL\b", "", (60, 835, 1670), 94, nvlink=300, network=50),
    _gpu("NVIDIA H100 PCIe", r"\bH100\b.*\bPCIe\b", "", (51.2, 756, 1513), 80, nvlink=300, network=50),
    _gpu("NVIDIA H100 SXM", r"\bH100\b", "H100", (66.9, 989.4, 1978.9), 80, nvlink=450, network=50),
    _gpu("NVIDIA A100", r"\bA100\b", "A100", (19.5, 312, None), 80, nvlink=300, network=25),
    _gpu("AMD Instinct MI300X", r"\bMI300X\b", "MI300X", (163.4, 1307.4, 2614.9), 192, nvlink=448, network=50),
    _tpu("TPU v6e", r"\bTPU v6 ?(lite|e)\b|\bv6e\b", "v6e", 918, 32, ici=448, cores=1, generation="v6e", hbm=1640),
    _tpu(
        "TPU v5e", r"\bTPU v5 ?(lite|e)\b|\bv5(litepod|e)\b", "v5e|v5litepod", 197, 16,
        ici=200, cores=1, generation="v5e", hbm=819,
    ),
    _tpu("TPU v5p", r"\bTPU v5p?$|\bTPU v5p\b|\bv5p\b", "v5p", 459, 95, ici=600, cores=2, generation="v5p", hbm=2765),
    _tpu("TPU v4", r"\bTPU v4\b|\bv4\b", "v4", 275, 32, ici=300, cores=2, generation="v4", hbm=1200),
    Chip(
        "AWS Trainium2", r"\btrn2u?\b|\bTrainium ?2\b", "trn2u?", 181 * TERA, 667 * TERA, 1299 * TERA, 96,
        fast_domain=16, fast_gbs=640, network_gbs=25, backend="xla",
        cores=8, cores_per_device=(2, 1), cores_variable="NEURON_LOGICAL_NC_CONFIG", core_name="NeuronCore",
    ),
    Chip(
        "AWS Trainium", r"\btrn1n?\b|\bTrainium ?1?\b", "trn1n?", 47.5 * TERA, 190 * TERA, 190 * TERA, 32,
        fast_domain=16, fast_gbs=192, network_gbs=6.25, backend="xla",
        cores=2, cores_per_device=(1,), cores_variable="NEURON_LOGICAL_NC_CONFIG", core_name="NeuronCore",
    ),
)  # fmt: skip


def chip_named(runtime_name: str) -> Optional[Chip]:
    """The chip a runtime's device name stands for, or None for one the catalogue lacks."""
    return next((c for c in CHIPS if re.search(c.runtime_name, runtime_name, flags=re.IGNORECASE)), None)


def device_of_hardware_id(hardware_id: str) -> Optional[Device]:
    """The device a hardware id's processes each drive, or None for an accelerator the catalogue lacks.

    A Trainium2 id may name its logical NeuronCore configuration (``trn2-lnc1-128x4``); without
    one it is the runtime's default, LNC=2 (``trn2-64x4``).
    """
    chip = next((c for c in CHIPS if c.id_name and re.search(rf"-(?:{c.id_name})-", f"-{hardware_id}-")), None)
    if chip is None:
        return None
    lnc = re.search(r"-lnc(\d+)-", f"-{hardware_id}-")
    return chip.device(int(lnc.group(1)) if lnc else None, key=f"hardware={hardware_id!r}: lnc")


@dataclass(frozen=True)
class TpuTopology:
    """A TPU slice the TPU compiler can target from any host (``v5p:4x4x4``, Google's ``v5p-128``)."""

    chip: Chip
    #: Chips along each torus axis.
    shape: tuple[int, ...]

    @property
    def name(self) -> str:
        """The compiler's topology name: ``v5p:4x4x4``."""
        return f"{self.chip.topology_generation}:{'x'.join(map(str, self.shape))}"

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    def device_memory_bytes(self, devices: int) -> float:
        """HBM of one of the compiler's ``devices`` of this slice (libtpu's compile-only v4 makes each
        TensorCore a device: half a chip)."""
        return self.chip.memory_gib * GIB * self.chips / devices


def tpu_topology(hardware: str, key: str = "hardware") -> TpuTopology:
    """The TPU slice ``hardware`` names: a compiler topology (``v5p:4x4x4``) or a TPU hardware id
    (``tpu-v5p-128``, which counts TensorCores: 64 v5p chips), refused by name when it is neither."""
    tpus = [chip for chip in CHIPS if chip.topology_generation]
    examples = "; ".join(
        f"{chip.topology_generation}:{'x'.join(map(str, chip.slice_shapes[0]))} .. "
        f"{'x'.join(map(str, chip.slice_shapes[-1]))} or tpu-{chip.topology_generation}-N"
        for chip in tpus
    )
    allowed = f"a TPU topology of the compiler's ({examples})"
    if named := re.fullmatch(r"(\w+):(\d+(?:x\d+)+)", hardware):
        chip = next((c for c in tpus if c.topology_generation == named.group(1)), None)
        shape = tuple(int(n) for n in named.group(2).split("x"))
        if chip is None or len(shape) != len(chip.slice_shapes[0]) or min(shape) < 1:
            raise ConfigError(key, hardware, allowed, reason=f"no TPU generation {named.group(1)!r} of that shape")
        return TpuTopology(chip, shape)
    device = device_of_hardware_id(hardware)
    counted = re.fullmatch(r"tpu-\w+-(\d+)", hardware)
    if device is None or counted is None or not device.chip.topology_generation:
        raise ConfigError(key, hardware, allowed)
    chip = device.chip
    chips = int(counted.group(1)) // chip.cores
    slice_shape: Optional[tuple[int, ...]] = next((s for s in chip.slice_shapes if math.prod(s) == chips), None)
    if slice_shape is None:
        sizes = ", ".join(f"tpu-{chip.topology_generation}-{math.prod(s) * chip.cores}" for s in chip.slice_shapes)
        raise ConfigError(key, hardware, sizes, reason=f"no {chip.name} slice of {chips} chips")
    return TpuTopology(chip, slice_shape)
