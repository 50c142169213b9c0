"""The planner's plan checked by the dry run: the same experiment traced at the plan's mesh and batch.

``axtorch-plan`` prices a formula (``axtorch.plan.memory``); the dry run (``axtorch.train.dry_run``)
traces the real training step on fake tensors and measures what is live at its peak. The check
composes the ``axtorch-train dry_run=true`` command the plan stands for, runs it in-process and
sets both figures side by side, by kind.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from axtorch.parallel.backend_kind import BackendKind
from axtorch.parallel.chips import GIB
from axtorch.plan.inputs import load_plan_inputs
from axtorch.plan.memory import DeviceMemory
from axtorch.train.dry_run import DryRunReport, dry_run
from axtorch.train.experiment import ExperimentConfig

#: ``check=null`` (the default) runs the dry run for models of at most this many layers: an 8B
#: model's 32 trace in about 25 s on 2 CPU cores, a 70B model's 80 in about 95.
AUTO_CHECK_MAX_LAYERS = 48


def check_refusal(config: ExperimentConfig) -> Optional[str]:
    """Why the dry run cannot check this plan, or None."""
    if config.backend is BackendKind.xla:
        return "the dry run traces the native backend's program, not XLA's"
    return None


def runs_by_default(config: ExperimentConfig) -> bool:
    """Whether ``check=null`` runs the dry run: a model small enough to trace in under a minute."""
    return config.model.decoder.num_layers <= AUTO_CHECK_MAX_LAYERS


def global_rows(config: ExperimentConfig, mesh: Mapping[str, int], batch: int) -> int:
    """``trainer.batch_size`` for ``batch`` sequences per device per micro-batch (``axtorch-plan batch=``):
    one such batch on each data-parallel replica, for each gradient-accumulation step or, with
    pipeline stages, for each of the plan's micro-batches."""
    replicas = mesh.get("data", 1) * mesh.get("fsdp", 1) * mesh.get("expert", 1)
    microbatches = config.pipeline.planned_microbatches(mesh.get("pipe", 1))
    return batch * replicas * config.trainer.grad_accum_steps * microbatches


@dataclass
class PlanCheck:
    """The dry run of a plan and the command that reproduces it."""

    command: str
    report: DryRunReport
    seconds: float
    #: Whether the traced model recomputes activations (``model/remat``).
    remat: bool = False


def check_plan(
    overrides: Sequence[str],
    rows: int,
    seq_len: int,
    devices: Optional[int] = None,
    config_dirs: Sequence[str] = (),
) -> PlanCheck:
    """Trace the training step of ``overrides`` (an experiment and its mesh) on the native backend,
    ``rows`` sequences of ``seq_len`` a step, as ``axtorch-train dry_run=true`` does."""
    native = [] if any(o.startswith("backend=") for o in overrides) else ["backend=native"]  # xla: refused before
    traced = [*overrides, *native, f"trainer.batch_size={rows}", f"data.seq_len={seq_len}"]
    started = time.perf_counter()
    config, mesh = load_plan_inputs(traced, devices, config_dirs)
    report = dry_run(config, mesh)
    device_count = [f"devices={devices}"] if devices is not None else []
    command = " ".join(["axtorch-train", "dry_run=true", *traced, *device_count])
    return PlanCheck(command, report, time.perf_counter() - started, config.model.decoder.remat is not None)


def by_kind(report: DryRunReport) -> dict[str, int]:
    """The dry run's peak in the planner's kinds (weights, gradients and optimizer state, activations, other)."""
    traced = report.memory_at_peak
    return {
        "weights": traced["parameters"] + traced["parameters, gathered"],
        "gradients + optimizer state": traced["gradients"] + traced["gradients, unsharded"] + traced["optimizer state"],
        "activations": traced["activations"],
        "other (temporaries, collective buffers)": traced["temporaries"] + traced["collective buffers"],
    }


def planned_by_kind(memory: DeviceMemory) -> dict[str, int]:
    """The planner's figures in the same kinds as ``by_kind``, at the moment of its peak."""
    if memory.at_backward_start_bytes < memory.at_backward_end_bytes:
        return {
            "weights": memory.parameter_bytes,
            "gradients + optimizer state": memory.gradient_bytes + memory.optimizer_bytes,
            "activations": 0,
            "other (temporaries, collective buffers)": 0,
        }
    return {
        "weights": memory.parameter_bytes + memory.gathered_bytes,
        "gradients + optimizer state": memory.optimizer_bytes,
        "activations": memory.activation_bytes,
        "other (temporaries, collective buffers)": memory.head_bytes,
    }


def format_check(
    check: PlanCheck,
    planned_total: float,
    planned: Optional[DeviceMemory] = None,
    step_seconds: Optional[tuple[dict[str, float], dict[str, float]]] = None,
) -> str:
    """The planner's per-device memory (by kind where ``planned`` is given) and the dry run's, side
    by side, with the command that runs the dry run again; and ``step_seconds``, the step time by
    cause from the planner's formulas and from the dry run's FLOPs and collectives."""
    traced = by_kind(check.report)
    priced = planned_by_kind(planned) if planned is not None else {}
    width = max(len(kind) for kind in traced)
    lines = [
        f"checked by the dry run ({check.seconds:.0f} s): {check.command}",
        f"  {'GiB a device':<{width}}  {'planner':>9}  {'dry run':>9}",
    ]
    for kind, value in traced.items():
        price = f"{priced[kind] / GIB:9.3f}" if kind in priced else f"{'-':>9}"
        lines.append(f"  {kind:<{width}}  {price}  {value / GIB:9.3f}")
    peak = check.report.peak_bytes
    lines.append(f"  {'peak':<{width}}  {planned_total / GIB:9.3f}  {peak / GIB:9.3f}")
    lines.append(f"  the planner's peak is {planned_total / peak:.2f}x the dry run's: the dry run's is the program's")
    if len(check.report.ranks) > 1:
        fullest, busiest = check.report.fullest.name, check.report.busiest.name
        lines.append(
            f"  the dry run's memory is its fullest traced rank's ({fullest}), its step the busiest's ({busiest})"
        )
    if step_seconds is not None:
        lines.extend(_step_lines(*step_seconds))
    if check.remat:
        lines.append(
            "  except under remat: torch's memory tracker reads more activations than autograd keeps, also on "
            "real tensors: take them as an upper bound (docs/parallelism.md)"
        )
    return "\n".join(lines)


def _step_lines(planned: dict[str, float], traced: dict[str, float]) -> list[str]:
    # Compute always; another cause where it takes a thousandth of the step (a gradient norm's
    # all-reduced scalars do not).
    every = [*planned, *(cause for cause in traced if cause not in planned)]
    least = 1e-3 * max(sum(planned.values()), sum(traced.values()))
    causes = [c for c in every if c == "compute" or max(planned.get(c, 0.0), traced.get(c, 0.0)) >= least]
    width = max(len(cause) for cause in [*causes, "step time, seconds"])
    lines = [f"  {'step time, seconds':<{width}}  {'planner':>9}  {'dry run':>9}"]
    for cause in causes:
        lines.append(f"  {cause:<{width}}  {planned.get(cause, 0.0):9.4g}  {traced.get(cause, 0.0):9.4g}")
    lines.append(f"  {'step':<{width}}  {sum(planned.values()):9.4g}  {sum(traced.values()):9.4g}")
    lines.append(
        "  the dry run's column prices the traced program's FLOPs and collectives (the bytes of each, over the "
        "slowest link its group spans) with the planner's rates"
    )
    return lines
