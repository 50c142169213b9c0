"""The search's best candidates for a TPU slice, compiled by the TPU compiler and ranked by what it says.

The planner ranks meshes by a formula; for a TPU slice ``axtorch-plan hardware=tpu-... compile=N``
also compiles the best ``N`` (each the xla backend's real step, as ``axtorch-train dry_run=true
backend=xla hardware=...`` compiles it, in a process of its own: torch_xla's runtime is per
process) and ranks them again: those the compiler fits in a chip's HBM first, then by the time
its own cost analysis implies at the chip's peak (its FLOPs) and HBM bandwidth (its bytes
accessed), whichever is longer. Both rankings are printed.

Run as a module, it compiles one candidate and prints the compiler's figures as one JSON line::

    python -m axtorch.plan.compiled_ranking tpu-v5p-8 model=llama_debug backend=xla mesh.fsdp=4 sharding=fsdp
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from axtorch.config.errors import ConfigError
from axtorch.parallel.chips import GIB, Chip, tpu_topology
from axtorch.plan.search import Candidate


@dataclass
class CompiledCandidate:
    candidate: Candidate
    #: The compiler's HBM a device needs (``CompiledStep.hbm_bytes``); None where it did not compile.
    hbm_bytes: Optional[int] = None
    flops: float = 0.0
    bytes_accessed: float = 0.0
    compile_seconds: float = 0.0
    #: The compiler's own words where it could not fit the step, or why it did not compile.
    refusal: Optional[str] = None

    def fits(self, capacity_bytes: float) -> bool:
        return self.hbm_bytes is not None and self.hbm_bytes <= capacity_bytes

    def roofline_seconds(self, chip: Chip, devices_per_chip: int) -> float:
        """The step's time by the compiler's counts: its FLOPs at the chip's peak or its bytes at
        the chip's HBM bandwidth, whichever is longer, for one device's share of the chip."""
        peak = chip.bf16 / devices_per_chip
        bandwidth = (chip.hbm_gbs or 0.0) * 1e9 / devices_per_chip
        return max(self.flops / peak, self.bytes_accessed / bandwidth if bandwidth else 0.0)


def compile_candidates(
    candidates: Sequence[Candidate], overrides: Sequence[str], hardware: str, config_dirs: Sequence[str] = ()
) -> list[CompiledCandidate]:
    """Compile each candidate's step for ``hardware`` (a TPU slice), each in its own process."""
    tpu_topology(hardware)  # an id the compiler cannot take is refused before any compile
    env = {key: value for key, value in os.environ.items() if key not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    directories = [flag for directory in config_dirs for flag in ("--config-dir", directory)]
    compiled = []
    for candidate in candidates:
        command = [sys.executable, "-m", __name__, hardware, *directories, *overrides, *candidate.overrides()]
        result = subprocess.run(command, capture_output=True, text=True, env=env | {"TF_CPP_MIN_LOG_LEVEL": "2"})
        lines = result.stdout.strip().splitlines()
        if result.returncode != 0 or not lines:
            said = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
            compiled.append(CompiledCandidate(candidate, refusal=f"did not compile: {said[:200]}"))
            continue
        figures = json.loads(lines[-1])
        if "environment" in figures:  # the same for every candidate: no compiler here
            raise ConfigError("compile", len(candidates), "0 here, or run in the tpu extra's environment",
                              reason=figures["environment"])  # fmt: skip
        compiled.append(CompiledCandidate(candidate, **figures))
    return compiled


def format_compiled_ranking(compiled: Sequence[CompiledCandidate], hardware: str) -> str:
    """The compiled candidates, ranked by the compiler: those that fit first, then its roofline time."""
    topology = tpu_topology(hardware)
    chip = topology.chip
    ranked = []
    for entry in compiled:
        devices = math.prod(entry.candidate.mesh.values())
        per_chip = max(1, devices // topology.chips)  # libtpu's compile-only v4: a device a TensorCore
        capacity = topology.device_memory_bytes(devices)
        ranked.append((not entry.fits(capacity), entry.roofline_seconds(chip, per_chip), entry, capacity))
    ranked.sort(key=lambda item: (item[0], item[1]))
    planner_rank = {id(entry): index for index, entry in enumerate(compiled, 1)}
    lines = [
        f"the best {len(compiled)} compiled for {topology.name} by the TPU compiler, ranked by what it says "
        "(fits first, then its FLOPs at the chip's peak or its bytes at the HBM bandwidth, the longer):",
        f"  rank  planner's  {'mesh, sharding, remat':<44}  HBM GiB  fits     step s  compile s",
    ]
    for rank, (_, seconds, entry, capacity) in enumerate(ranked, 1):
        mesh = " ".join(f"{axis}={size}" for axis, size in entry.candidate.mesh.items() if size > 1) or "1 device"
        what = f"{mesh}, {entry.candidate.sharding}, {entry.candidate.remat}"
        start = f"  {rank:>4}  {planner_rank[id(entry)]:>9}  {what:<44}"
        if entry.hbm_bytes is None:
            lines.append(f"{start}  {entry.refusal}")
            continue
        fits = "yes" if entry.fits(capacity) else "NO"
        lines.append(f"{start}  {entry.hbm_bytes / GIB:7.3f}  {fits:>4}  {seconds:9.3g}  {entry.compile_seconds:9.1f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """Compile one candidate (``HARDWARE [--config-dir DIR] OVERRIDE...``); print its figures as JSON."""
    from axtorch.compose.registry import register_configs
    from axtorch.plan.inputs import load_plan_inputs
    from axtorch.train.tpu_compiler import DoesNotFit

    hardware, *rest = sys.argv[1:] if argv is None else argv
    overrides, config_dirs = [], []
    arguments = iter(rest)
    for argument in arguments:
        if argument == "--config-dir":  # as compile_candidates passes them
            config_dirs.append(next(arguments))
        else:
            overrides.append(argument)
    register_configs()
    try:
        from axtorch.train.xla_dry_run import xla_dry_run

        config, mesh = load_plan_inputs(overrides, None, config_dirs)
        step = xla_dry_run(config, mesh, tpu_topology(hardware)).compiled
        assert step is not None
        figures: dict = {
            "hbm_bytes": step.hbm_bytes,
            "flops": step.flops,
            "bytes_accessed": step.bytes_accessed,
            "compile_seconds": step.compile_seconds,
        }
    except DoesNotFit as error:
        figures = {"refusal": error.message.splitlines()[0], "compile_seconds": error.compile_seconds}
    except ImportError as error:
        figures = {"environment": str(error)}
    except ConfigError as error:  # the compiler's extra is missing (hardware), or this candidate cannot compile
        figures = {"environment": str(error)} if error.key == "hardware" else {"refusal": str(error)}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
