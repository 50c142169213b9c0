"""``axtorch-plan``: how a model splits over a mesh and what each device must hold, without any device.

Takes the same overrides as ``axtorch-train`` (and its ``--config-dir``) plus a few plan-only
options, builds the model on the meta device, resolves the sharding rules against the mesh and
prints the per-parameter placement and the per-device memory and FLOPs, in seconds even for 405B::

    axtorch-plan model=llama3_70b mesh.fsdp=32 mesh.model=8 sharding=fsdp_tp
    axtorch-plan model=llama3_8b mesh.fsdp=-1 devices=64 sharding=fsdp batch=2 seq_len=8192 model/remat=full
    axtorch-plan model=mixtral_8x7b mesh.expert=8 mesh.fsdp=32 sharding=fsdp_ep
    axtorch-plan model=llama3_70b mesh.pipe=4 mesh.fsdp=8 mesh.model=8 sharding=fsdp_tp pipeline.microbatches=16

Plan-only options: ``batch=`` (sequences per device, per micro-batch under ``mesh.pipe``;
default 1), ``seq_len=`` (default ``data.seq_len``), ``devices=`` (the device count, needed
only when a mesh axis is -1; otherwise the product of the mesh axes) and ``check=`` (the dry run
of the plan beside it: by default for models of at most 48 layers, ``axtorch.plan.check``). The activation estimate
follows the model's own remat policy (``model/remat=full|selective``) and ``trainer.precision``
(4 bytes a value under fp32, 2 under bf16), as training does.

With ``hardware=<id>`` (or ``devices=N device_memory=80GiB``) it searches instead: meshes and
remat policies ranked by an analytical step time at the device's peak for ``trainer.precision``
(``axtorch.plan.search``), ``global_batch=`` sequences per step (default: one per device), the
best ``top=`` (5) printed, and the first as a mesh rule to save under ``mesh_rules/``::

    axtorch-plan model=llama3_70b hardware=tpu-v5p-512 seq_len=8192 trainer.precision=bf16
    axtorch-plan model=llama3_8b hardware=trn2-64x4     # 4 trn2.48xlarge, a logical NeuronCore each
    axtorch-plan model=llama3_1b hardware=tpu-v5p-16 compile=3   # the best 3 compiled by the TPU compiler

With ``compile=N`` and a TPU ``hardware`` (in the ``tpu`` extra's environment) the best ``N`` are
compiled for the slice and ranked again by the compiler's own figures
(``axtorch.plan.compiled_ranking``); both rankings are printed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from axtorch.cli.key_values import asks_for_help, format_help, parse_key_values, split_own_keys
from axtorch.cli.train import split_arguments
from axtorch.config.errors import ConfigError
from axtorch.plan import DeviceMemory, Planner, cluster_for, format_candidates, format_plan, load_plan_inputs, plan
from axtorch.plan.check import check_plan, check_refusal, format_check, global_rows, runs_by_default
from axtorch.plan.compiled_ranking import compile_candidates, format_compiled_ranking
from axtorch.train.dry_run import DryRunReport
from axtorch.train.experiment import ExperimentConfig


@dataclass
class PlanOptions:
    """The command-line options that size the plan but are not part of the experiment config."""

    #: Sequences per device (per micro-batch under mesh.pipe).
    batch: int = 1
    #: Tokens per sequence (default: data.seq_len).
    seq_len: Optional[int] = None
    #: The device count, needed only when a mesh axis is -1 (default: the product of the mesh axes).
    devices: Optional[int] = None
    #: Search meshes for this cluster (``gpu-H100-8x32``, ``tpu-v5p-512``, ``trn2-64x4``) instead of planning one.
    hardware: Optional[str] = None
    #: GiB per device (``80`` or ``80GiB``): overrides the cluster's,
    #: or with ``devices`` alone searches an H100-class cluster.
    device_memory: Optional[float] = None
    #: Sequences per step for the search (default: one per device).
    global_batch: Optional[int] = None
    #: How many of the best meshes the search prints.
    top: int = 5
    #: Check the plan (the search's best) with the dry run, its figures beside the planner's: true,
    #: false, or null (default): when the model has at most 48 layers (under a minute; an 8B
    #: model's 32 take about 25 s on 2 CPU cores).
    check: Optional[bool] = None
    #: With a TPU ``hardware``: compile the search's best this many with the TPU compiler (the ``tpu``
    #: extra; each a few seconds for a small model, minutes for billions) and rank them by its HBM,
    #: FLOPs and bytes beside the formula's ranking.
    compile: int = 0

    def validate(self) -> None:
        for key in ("batch", "seq_len", "devices", "global_batch", "top"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(key, value, "a positive integer")
        if self.compile < 0:
            raise ConfigError("compile", self.compile, "a count of candidates to compile, 0 for none")
        if self.compile and not (self.hardware or "").startswith("tpu-"):
            raise ConfigError("compile", self.compile, "0 unless hardware= names a TPU slice (tpu-v5p-128)")
        if self.device_memory is not None and self.device_memory <= 0:
            raise ConfigError("device_memory", self.device_memory, "a positive size in GiB, e.g. 80GiB")


def split_plan_options(argv: Sequence[str]) -> tuple[list[str], PlanOptions]:
    """Separate the plan-only ``key=value`` options (checked) from the config overrides."""
    own, overrides = split_own_keys(argv, PlanOptions)
    # device_memory=80GiB: the unit is optional, GiB either way.
    own = [arg.removesuffix("GiB").removesuffix("GB") if arg.startswith("device_memory=") else arg for arg in own]
    options = parse_key_values(own, PlanOptions)
    options.validate()
    return overrides, options


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``axtorch-plan``; returns 2 on a configuration error."""
    argv = sys.argv[1:] if argv is None else argv
    if asks_for_help(argv):
        print(
            format_help(
                "axtorch-plan", __doc__ or "", PlanOptions, "[--config-dir DIR] TRAIN_OVERRIDE... key=value ..."
            )
        )
        return 0
    try:
        arguments, config_dirs = split_arguments(argv)
        overrides, options = split_plan_options(arguments)
        if options.hardware is not None or options.device_memory is not None:
            print(search_report(overrides, options, config_dirs))
            return 0
        config, mesh_sizes = load_plan_inputs(overrides, options.devices, config_dirs)
        result = plan(config, mesh_sizes, options.batch, options.seq_len)
        print(format_plan(result))
        rows = global_rows(config, mesh_sizes, options.batch)
        memory = result.memory
        check = checked(
            overrides, config, mesh_sizes, rows, result.seq_len, options, config_dirs, memory.total_bytes, memory
        )
        if check is not None:
            print(check)
    except ConfigError as error:
        print(f"axtorch-plan: {error}", file=sys.stderr)
        return 2
    return 0


def checked(
    overrides: Sequence[str],
    config: ExperimentConfig,
    mesh: dict[str, int],
    rows: int,
    seq_len: int,
    options: PlanOptions,
    config_dirs: Sequence[str],
    planned_total: float,
    planned: Optional[DeviceMemory] = None,
    step_time: Optional[tuple[dict[str, float], Callable[[DryRunReport], dict[str, float]]]] = None,
) -> Optional[str]:
    """The dry run's check of a plan (``PlanOptions.check``), why there is none, or None with ``check=false``.

    ``step_time``: the plan's step time by cause, and how to price a dry run's step the same way."""
    if options.check is False:
        return None
    if refusal := check_refusal(config):
        if options.check:
            raise ConfigError("check", True, "false for this plan", reason=refusal)
        return f"not checked by the dry run: {refusal}"
    if options.check is None and not runs_by_default(config):
        layers = config.model.decoder.num_layers
        return (
            f"not checked by the dry run: {layers} layers trace in about a minute (a 70B model's 80 take about "
            f"60 s on 2 CPU cores); check=true runs it"
        )
    check = check_plan(overrides, rows, seq_len, options.devices, config_dirs)
    step_seconds = None if step_time is None else (step_time[0], step_time[1](check.report))
    return format_check(check, planned_total, planned, step_seconds)


def search_report(overrides: Sequence[str], options: PlanOptions, config_dirs: Sequence[str] = ()) -> str:
    """Search the meshes of ``options.hardware`` (or an H100-class cluster of ``devices``) and report the best."""
    hardware = options.hardware
    if hardware is None:
        if options.devices is None:
            raise ConfigError("devices", None, "the device count, with device_memory= and no hardware=")
        per_host = math.gcd(options.devices, 8)
        hardware = f"gpu-H100-{per_host}x{options.devices // per_host}"
    cluster = cluster_for(hardware, options.device_memory)
    presets = ("fsdp", "fsdp_tp", "fsdp_ep")
    configs = {name: load_plan_inputs([*overrides, f"sharding={name}"], config_dirs=config_dirs)[0] for name in presets}
    config = configs["fsdp"]
    planner = Planner(
        config,
        {name: each.sharding for name, each in configs.items()},
        cluster,
        options.seq_len or config.data.seq_len,
        options.global_batch or cluster.devices,
    )
    candidates = planner.search()
    report = format_candidates(candidates, cluster, config.trainer.precision, options.top)
    if not candidates:
        return report
    if options.compile:
        sized = [*overrides, f"data.seq_len={planner.seq_len}", f"trainer.batch_size={planner.global_batch}"]
        compiled = compile_candidates(candidates[: options.compile], sized, hardware, config_dirs)
        report = f"{report}\n{format_compiled_ranking(compiled, hardware)}"
    best = candidates[0]
    with_best = [*overrides, *best.overrides()]
    best_config, _ = load_plan_inputs(with_best, cluster.devices, config_dirs)
    rows, seq_len = planner.global_batch, planner.seq_len
    bubble = best_config.pipeline.bubble(best.mesh["pipe"], best.microbatches)  # 0 without stages
    step_time = (
        best.parts,
        lambda traced: planner.step_time.traced_parts(best.mesh, traced.flops, traced.collectives, bubble),
    )
    check = checked(
        with_best, best_config, best.mesh, rows, seq_len, options, config_dirs, best.memory_bytes, step_time=step_time
    )
    return report if check is None else f"{report}\n{check}"


if __name__ == "__main__":
    raise SystemExit(main())
