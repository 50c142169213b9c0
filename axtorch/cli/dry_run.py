"""``axtorch-train dry_run=true ...``: the run's real training step at its real size, on fake tensors.

Takes the same overrides as a run (and ``--config-dir``), plus the dry run's own options below,
and prints per traced rank the memory at the step's peak by kind, the collectives and FLOPs of a
step, and, given the hardware, whether it fits (``axtorch/train/dry_run.py``)::

    axtorch-train dry_run=true model=llama3_8b backend=native mesh.fsdp=-1 devices=64 sharding=fsdp
    axtorch-train dry_run=true model=llama3_8b backend=native mesh.fsdp=8 sharding=fsdp hardware=gpu-H100-8x1

With ``backend=xla`` it runs the xla backend's own dry run instead (``axtorch/train/xla_dry_run.py``:
the step traced lazily by torch_xla, never run, its shardings held to the rules)::

    axtorch-train dry_run=true model=llama3_8b backend=xla mesh.fsdp=64 sharding=fsdp

It exits 0, 2 for a config that cannot run (before any tracing), 4 when the peak exceeds the
hardware's device memory, and 5 when the XLA program splits a tensor otherwise than the rules ask.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from axtorch.cli.key_values import parse_key_values, split_own_keys
from axtorch.config.errors import ConfigError
from axtorch.parallel.backend_kind import BackendKind
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


def split_dry_run_options(argv: Sequence[str]) -> tuple[list[str], DryRunOptions]:
    own, overrides = split_own_keys(argv, DryRunOptions)
    options = parse_key_values(own, DryRunOptions)
    for key in ("devices", "steps"):
        value = getattr(options, key)
        if value is not None and value <= 0:
            raise ConfigError(key, value, "a positive integer")
    return overrides, options


def run_dry(overrides: Sequence[str], config_dirs: Sequence[str]) -> int:
    """The dry run of ``overrides`` (with its own options among them); the process's exit code."""
    try:
        overrides, options = split_dry_run_options(overrides)
        if not options.dry_run:
            raise ConfigError("dry_run", False, "true, or leave it out to train")
        named = cluster_for(options.hardware) if options.hardware else None
        devices = options.devices or (named.devices if named else None)
        config, mesh = load_plan_inputs(overrides, devices, config_dirs)
        hardware = options.hardware or config.mesh_rules.hardware  # a mesh rule's target, else none to fit
        cluster = named or (cluster_for(hardware) if hardware else None)
        capacity = cluster.memory_bytes if cluster else None
        if config.backend is BackendKind.xla:
            return _run_dry_xla(config, mesh, capacity, hardware)
        report = dry_run(config, mesh, options.steps)
    except ConfigError as error:
        print(f"axtorch-train: {error}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    print(format_report(report, capacity, hardware))
    return int(ExitCode.DOES_NOT_FIT if capacity is not None and report.peak_bytes > capacity else ExitCode.FINISHED)


def _run_dry_xla(
    config: ExperimentConfig, mesh: dict[str, int], capacity: Optional[float], hardware: Optional[str]
) -> int:
    """The xla backend's dry run: its traced program's shardings against the rules (``xla_dry_run``)."""
    try:
        from axtorch.train.xla_dry_run import format_xla_report, xla_dry_run

        report = xla_dry_run(config, mesh)
    except ImportError as error:  # no torch_xla in this environment: the xla backend's own message
        print(f"axtorch-train: {error}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    print(format_xla_report(report, capacity, hardware))
    if report.problems:
        return int(ExitCode.MISSHARDED)
    state = report.device_bytes("parameter") + report.device_bytes("AdamW moment")
    return int(ExitCode.DOES_NOT_FIT if capacity is not None and state > capacity else ExitCode.FINISHED)
