"""``axtorch-train dry_run=true ...``: the run's real training step at its real size, on fake tensors.

Takes the same overrides as a run (and ``--config-dir``), plus the dry run's own options below,
and prints per traced rank the memory at the step's peak by kind, the collectives and FLOPs of a
step, and, given the hardware, whether it fits (``axtorch/train/dry_run.py``)::

    axtorch-train dry_run=true model=llama3_8b backend=native mesh.fsdp=-1 devices=64 sharding=fsdp
    axtorch-train dry_run=true model=llama3_8b backend=native mesh.fsdp=8 sharding=fsdp hardware=gpu-H100-8x1

With ``backend=xla`` it runs the xla backend's own dry run instead (``axtorch/train/xla_dry_run.py``:
the step traced lazily by torch_xla, never run, its shardings held to the rules); with a TPU
``hardware`` it also compiles that step for the slice with the TPU compiler, without a TPU
(``compile=false``: the shardings only)::

    axtorch-train dry_run=true model=llama3_8b backend=xla mesh.fsdp=64 sharding=fsdp
    axtorch-train dry_run=true model=llama3_1b backend=xla mesh.fsdp=8 sharding=fsdp hardware=v5p:2x2x2

It exits 0, 2 for a config that cannot run (before any tracing), 4 when the peak exceeds the
hardware's device memory (or the TPU compiler cannot fit the step), and 5 when the XLA program
splits a tensor otherwise than the rules ask.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from axtorch.cli.key_values import parse_key_values, split_own_keys
from axtorch.config.errors import ConfigError
from axtorch.parallel.backend_kind import BackendKind
from axtorch.parallel.chips import TpuTopology, tpu_topology
from axtorch.plan import cluster_for, load_plan_inputs
from axtorch.train.dry_run import dry_run, format_report
from axtorch.train.exit_codes import ExitCode
from axtorch.train.experiment import ExperimentConfig


@dataclass
class DryRunOptions:
    """The dry run's own options, apart from the experiment config."""

    #: Trace the real training step on fake tensors instead of training.
    dry_run: bool = False
    #: The device count (world size); default: the hardware's, else the product of the mesh axes.
    devices: Optional[int] = None
    #: The hardware id whose device memory the peak must fit (``gpu-H100-8x8``); default: ``mesh_rules.hardware``.
    hardware: Optional[str] = None
    #: Training steps traced, each with the optimizer state made first, as in the steady state.
    steps: int = 1
    #: With ``backend=xla`` and a TPU ``hardware`` (``tpu-v5p-128`` or the compiler's ``v5p:4x4x4``):
    #: compile the traced step with the TPU compiler (the ``tpu`` extra), true by default there;
    #: false checks the traced program's shardings only, in seconds.
    compile: Optional[bool] = None
    #: The TPU compiler's optimization effort, -1 to 1 (0: its default, as on a TPU). -1 compiles in
    #: less of this host's time and memory (8B over fsdp=64: 20 GB, where 0 needs more than 24),
    #: at some more HBM in its figures.
    compile_effort: float = 0.0


def split_dry_run_options(argv: Sequence[str]) -> tuple[list[str], DryRunOptions]:
    own, overrides = split_own_keys(argv, DryRunOptions)
    options = parse_key_values(own, DryRunOptions)
    for key in ("devices", "steps"):
        value = getattr(options, key)
        if value is not None and value <= 0:
            raise ConfigError(key, value, "a positive integer")
    if not -1.0 <= options.compile_effort <= 1.0:
        raise ConfigError("compile_effort", options.compile_effort, "a number from -1 (least) to 1 (most)")
    return overrides, options


def run_dry(overrides: Sequence[str], config_dirs: Sequence[str]) -> int:
    """The dry run of ``overrides`` (with its own options among them); the process's exit code."""
    try:
        overrides, options = split_dry_run_options(overrides)
        if not options.dry_run:
            raise ConfigError("dry_run", False, "true, or leave it out to train")
        hardware_named = options.hardware or ""
        asked = _names_tpu(hardware_named) and options.compile is not False
        topology = tpu_topology(hardware_named) if asked else None
        if options.compile and topology is None:
            raise ConfigError("compile", True, "with backend=xla and a TPU hardware= (tpu-v5p-128, v5p:4x4x4)")
        named = cluster_for(options.hardware) if options.hardware and ":" not in options.hardware else None
        devices = options.devices or (named.devices if named else topology.chips if topology else None)
        config, mesh = load_plan_inputs(overrides, devices, config_dirs)
        hardware = options.hardware or config.mesh_rules.hardware  # a mesh rule's target, else none to fit
        cluster = named or (cluster_for(hardware) if hardware and ":" not in hardware else None)
        capacity = cluster.memory_bytes if cluster else None
        if config.backend is BackendKind.xla:
            return _run_dry_xla(config, mesh, capacity, hardware, topology, options.compile_effort)
        if options.compile:
            raise ConfigError("compile", True, "with backend=xla: the TPU compiler compiles the xla backend's step")
        if cluster is None and topology is not None:
            raise ConfigError(
                "hardware",
                options.hardware,
                f"a hardware id such as tpu-{topology.chip.topology_generation}-N with backend=native",
                reason="a TPU topology names what the TPU compiler compiles: the xla backend's step (backend=xla)",
            )
        report = dry_run(config, mesh, options.steps)
    except ConfigError as error:
        print(f"axtorch-train: {error}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    print(format_report(report, capacity, hardware))
    return int(ExitCode.DOES_NOT_FIT if capacity is not None and report.peak_bytes > capacity else ExitCode.FINISHED)


def _names_tpu(hardware: str) -> bool:
    """Whether ``hardware`` names a TPU slice: a compiler topology (``v5p:4x4x4``) or a ``tpu-`` id."""
    return ":" in hardware or hardware.startswith("tpu-")


def _run_dry_xla(
    config: ExperimentConfig,
    mesh: dict[str, int],
    capacity: Optional[float],
    hardware: Optional[str],
    topology: Optional[TpuTopology],
    compile_effort: float,
) -> int:
    """The xla backend's dry run: its traced program's shardings against the rules (``xla_dry_run``),
    and, for a TPU slice, the step compiled for it by the TPU compiler."""
    try:
        from axtorch.train.tpu_compiler import DoesNotFit
        from axtorch.train.xla_dry_run import format_xla_report, xla_dry_run

        report = xla_dry_run(config, mesh, topology, compile_effort)
    except ImportError as error:  # no torch_xla in this environment: the xla backend's own message
        print(f"axtorch-train: {error}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    except DoesNotFit as error:
        said = error.message.splitlines()
        shown = said[: next((i for i, line in enumerate(said) if line.strip().startswith("4. Size")), len(said))]
        print(
            f"dry run (xla): the TPU compiler could not fit the step in a device's memory of {error.topology} "
            f"(after {error.compile_seconds:.1f} s); it says:\n" + "\n".join(shown)
        )
        if len(shown) < len(said):
            print(f"  ... ({len(said) - len(shown)} more lines of the compiler's: the next largest allocations)")
        return int(ExitCode.DOES_NOT_FIT)
    needed: float = report.device_bytes("parameter") + report.device_bytes("AdamW moment")
    if topology is not None and report.compiled is not None:
        capacity, needed = topology.device_memory_bytes(report.compiled.devices), report.compiled.hbm_bytes
    print(format_xla_report(report, capacity, hardware))
    if report.problems:
        return int(ExitCode.MISSHARDED)
    return int(ExitCode.DOES_NOT_FIT if capacity is not None and needed > capacity else ExitCode.FINISHED)
