"""``axtorch-plan``: how a model splits over a mesh and what each device must hold, without any device.

Takes the same overrides as ``axtorch-train`` plus a few plan-only options, builds the model on
the meta device, resolves the sharding rules against the mesh and prints the per-parameter
placement and the per-device memory and FLOPs, in seconds even for 405B::

    axtorch-plan model=llama3_70b mesh.fsdp=32 mesh.model=8 sharding=fsdp_tp
    axtorch-plan model=llama3_8b mesh.fsdp=-1 devices=64 sharding=fsdp batch=2 seq_len=8192 model/remat=full
    axtorch-plan model=mixtral_8x7b mesh.expert=8 mesh.fsdp=32 sharding=fsdp_ep
    axtorch-plan model=llama3_70b mesh.pipe=4 mesh.fsdp=8 mesh.model=8 sharding=fsdp_tp pipeline.microbatches=16

Plan-only options: ``batch=`` (sequences per device, per micro-batch under ``mesh.pipe``;
default 1), ``seq_len=`` (default ``data.seq_len``) and ``devices=`` (the device count, needed
only when a mesh axis is -1; otherwise the product of the mesh axes). The activation estimate
follows the model's own remat policy (``model/remat=full|selective``), as training does.

With ``hardware=<id>`` (or ``devices=N device_memory=80GiB``) it searches instead: meshes and
remat policies ranked by an analytical step time (``plan_search``), ``global_batch=`` sequences
per step (default: one per device), the best ``top=`` (5) printed, and the first as a mesh rule::

    axtorch-plan model=llama3_70b hardware=tpu-v5p-512 seq_len=8192
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from axtorch.compose.experiment import compose_experiment_config, to_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.config.serialize import to_object
from axtorch.layers.remat import RematConfig
from axtorch.models.causal_lm import CausalLMConfig
from axtorch.parallel.factory import BackendKind
from axtorch.parallel.hardware import device_count
from axtorch.parallel.mesh import MESH_AXES, MeshConfig
from axtorch.parallel.pipeline_config import layer_ranges, stage_parameter_names, stages_of_process
from axtorch.parallel.rules import PartitionSpec, resolve_parameter_specs, shard_shape
from axtorch.train.config import Precision
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.flops import active_parameters, model_flops_per_token

FP32_BYTES = 4
ACTIVATION_BYTES = 2  # the activation formula counts 16-bit (bf16) values
GIB = 1024**3


@dataclass(frozen=True)
class ParameterGroup:
    """Parameters that differ only in their layer index, e.g. ``decoder.layers.{0..79}.attention.q_proj.weight``."""

    name: str
    count: int
    shape: tuple[int, ...]
    spec: PartitionSpec
    shard_shape: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """Placement and per-device memory of one model on one mesh; byte counts are per device."""

    mesh_sizes: dict[str, int]
    parameters: list[ParameterGroup]
    total_parameters: int
    #: Parameters one token uses: all of them, except a mixture of experts' unchosen experts.
    active_parameters: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    batch_size: int
    seq_len: int
    #: The remat policy the activation estimate assumes: none, full or selective.
    remat: str
    flops_per_token: float
    #: Under ``mesh.pipe``: each stage's layers, and the share of a step the pipeline idles.
    stage_layers: Optional[list[range]] = None
    bubble: Optional[float] = None
    #: The precision policy, as the run would apply it.
    precision: str = "fp32 throughout"

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_sizes.values())

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes


def plan(
    config: ExperimentConfig,
    mesh_sizes: Mapping[str, int],
    batch_size: int = 1,
    seq_len: Optional[int] = None,
) -> Plan:
    """Resolve ``config.sharding`` for ``config.model`` on ``mesh_sizes`` and size what each device holds.

    Parameters and gradients are fp32 and AdamW keeps two fp32 moments, each split as its
    parameter is. ``batch_size`` is sequences per device; ``seq_len`` defaults to ``data.seq_len``.
    Raises ``ConfigError`` for rules that do not fit the model or mesh.
    """
    model = config.model
    seq_len = config.data.seq_len if seq_len is None else seq_len
    for key, value in (("batch", batch_size), ("seq_len", seq_len)):
        if value <= 0:
            raise ConfigError(key, value, "a positive integer")
    if seq_len > model.max_seq_len:
        raise ConfigError("seq_len", seq_len, f"at most model.max_seq_len={model.max_seq_len}")
    with torch.device("meta"):
        network = model.build()
    named_shapes = {name: tuple(p.shape) for name, p in network.named_parameters()}
    specs = resolve_parameter_specs(named_shapes, config.sharding, mesh_sizes)
    shards = {name: math.prod(shard_shape(named_shapes[name], spec, mesh_sizes)) for name, spec in specs.items()}
    total = sum(math.prod(shape) for shape in named_shapes.values())
    # Context parallelism gives each device a slice of every sequence.
    activations = _activation_bytes(model, batch_size, seq_len // mesh_sizes.get("seq", 1), mesh_sizes.get("model", 1))
    shard_elements = sum(shards.values())
    stage_layers = bubble = None
    pipe = mesh_sizes.get("pipe", 1)
    if pipe > 1:
        pipeline = config.pipeline
        microbatches = pipeline.resolved_microbatches(pipe, 2 * pipeline.num_stages(pipe))
        pipeline.validate(pipe, model.decoder.num_layers, microbatches)
        stage_layers = layer_ranges(model.decoder.num_layers, pipeline.num_stages(pipe), pipeline.split_points)
        processes = [stages_of_process(rank, pipe, pipeline.stages_per_process) for rank in range(pipe)]
        held = [stage_parameter_names(named_shapes, stage_layers, stages) for stages in processes]
        shard_elements = max(sum(shards[name] for name in names) for names in held)
        first_layers = sum(len(stage_layers[stage]) for stage in processes[0])
        in_flight = pipeline.microbatches_in_flight(pipe, microbatches)
        activations = round(activations * first_layers / model.decoder.num_layers * in_flight)
        bubble = pipeline.bubble(pipe, microbatches)
    return Plan(
        mesh_sizes=dict(mesh_sizes),
        parameters=_group_layers(named_shapes, specs, mesh_sizes),
        total_parameters=total,
        active_parameters=active_parameters(network),
        parameter_bytes=FP32_BYTES * shard_elements,
        gradient_bytes=FP32_BYTES * shard_elements,
        optimizer_bytes=2 * FP32_BYTES * shard_elements,
        activation_bytes=activations,
        batch_size=batch_size,
        seq_len=seq_len,
        remat=_remat_name(model.decoder.remat),
        flops_per_token=model_flops_per_token(model, seq_len, network),
        stage_layers=stage_layers,
        bubble=bubble,
        precision=_precision(config),
    )


def _precision(config: ExperimentConfig) -> str:
    trainer = config.trainer
    float8 = config.model.float8
    linears = f"; decoder linears in float8 ({float8.recipe} scales, torchao)" if float8 is not None else ""
    if trainer.precision is Precision.fp32:
        return f"fp32{linears}" if linears else "fp32 throughout"
    fsdp = (
        f"; FSDP (native) gathers bf16 parameters and reduces gradients in {trainer.reduce_precision.value}"
        if config.backend is BackendKind.native
        else ""
    )
    return f"bf16 matmuls (autocast){linears}{fsdp}; parameters, gradients and AdamW state fp32"


def _activation_bytes(model: CausalLMConfig, batch: int, seq: int, tensor_parallel: int) -> int:
    """Activations the decoder keeps for the backward pass on one device, in bf16 bytes.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
    tensor parallelism ``t`` without sequence parallelism (the presets keep the layer boundary
    replicated over ``model``): per layer ``s*b*h*(10 + 24/t)`` bytes for sequence ``s``,
    per-device batch ``b`` and width ``h``. The paper's ``5*a*s/(h*t)`` term (the stored ``s x s``
    attention scores, softmax and dropout mask per head) is left out: attention here is
    ``scaled_dot_product_attention``, whose fused kernels (flash / memory-efficient, chosen for
    the causal mask on accelerators) keep O(s) state, not O(s^2). Under ``model/remat=full`` only
    each layer's input (``2*s*b*h`` bytes) is kept, plus one layer's full set while it is
    recomputed; ``selective`` adds the named activations it keeps (``_named_widths``).

    An estimate: the constants are for a GPT layer (4h MLP, dropout); embedding, logits and loss
    buffers, and the keys and values that context parallelism gathers, are not counted.
    """
    s, b, h, t = seq, batch, model.dim, tensor_parallel
    per_layer = s * b * h * (10 + 24 / t)
    layers = model.decoder.num_layers
    remat = model.decoder.remat
    if remat is None:
        return round(layers * per_layer)
    kept_width = h + sum(_named_widths(model, t)[name] for name in getattr(remat, "save", ()))
    return round(layers * ACTIVATION_BYTES * s * b * kept_width + per_layer)


def _named_widths(model: CausalLMConfig, tensor_parallel: int) -> dict[str, float]:
    """Features per token of each activation a selective policy can keep, on one device."""
    attention = model.decoder.layer.attention
    head_dim = attention.resolved_head_dim(model.dim)
    query = attention.num_heads * head_dim / tensor_parallel
    key_value = attention.resolved_kv_heads() * head_dim / tensor_parallel
    return {
        "attention_query": query,
        "attention_key": key_value,
        "attention_value": key_value,
        "attention_context": query,
        "attention_output": model.dim,
        "feed_forward_hidden": model.decoder.layer.feed_forward.hidden_dim / tensor_parallel,
        "feed_forward_output": model.dim,
    }


def _remat_name(remat: Optional[RematConfig]) -> str:
    return "none" if remat is None else type(remat).__name__.removesuffix("RematConfig").lower()


_INDEXED = re.compile(r"^(.*?\.)(\d+)(\..*)$")


def _group_layers(
    named_shapes: Mapping[str, tuple[int, ...]], specs: Mapping[str, PartitionSpec], mesh_sizes: Mapping[str, int]
) -> list[ParameterGroup]:
    """One row per parameter, with rows that differ only in the layer index merged (in first-seen order)."""
    indices: dict[tuple[str, tuple[int, ...], PartitionSpec], list[int]] = {}
    for name, shape in named_shapes.items():
        match = _INDEXED.match(name)
        template = f"{match.group(1)}{{}}{match.group(3)}" if match else name
        indices.setdefault((template, shape, specs[name]), []).append(int(match.group(2)) if match else -1)
    return [
        ParameterGroup(
            name=template.format(_index_set(ids)) if "{}" in template else template,
            count=len(ids),
            shape=shape,
            spec=spec,
            shard_shape=shard_shape(shape, spec, mesh_sizes),
        )
        for (template, shape, spec), ids in indices.items()
    ]


def _index_set(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``{0..2,5}``; a single index stays bare."""
    if len(ids) == 1:
        return str(ids[0])
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "{" + ",".join(f"{a}..{z}" if z > a else str(a) for a, z in runs) + "}"


def format_plan(result: Plan) -> str:
    """The human-readable report ``axtorch-plan`` prints."""
    mesh = " ".join(f"{axis}={size}" for axis, size in result.mesh_sizes.items())
    rows = [("parameter", "count", "global shape", "spec", "per-device shard")] + [
        (g.name, str(g.count), _shape(g.shape), _spec(g.spec), _shape(g.shard_shape)) for g in result.parameters
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    table.insert(1, "  ".join("-" * width for width in widths))
    memory = [
        ("parameters (fp32)", result.parameter_bytes),
        ("gradients (fp32)", result.gradient_bytes),
        ("AdamW state (2x fp32)", result.optimizer_bytes),
        (
            f"activations (bf16, batch {result.batch_size} x seq {result.seq_len}, remat={result.remat})",
            result.activation_bytes,
        ),
        ("total", result.total_bytes),
    ]
    label_width = max(len(label) for label, _ in memory)
    return "\n".join(
        [
            f"mesh: {mesh} ({result.num_devices} devices)",
            "",
            *table,
            "",
            f"total parameters: {result.total_parameters:,} ({result.total_parameters / 1e9:.2f}B)",
            f"active parameters per token: {result.active_parameters:,} ({result.active_parameters / 1e9:.2f}B)",
            "per-device memory:",
            *(f"  {label.ljust(label_width)}  {num_bytes / GIB:9.2f} GiB" for label, num_bytes in memory),
            f"training FLOPs per token (seq {result.seq_len}): {result.flops_per_token:.3e}",
            f"precision: {result.precision}",
            *_pipeline_lines(result),
        ]
    )


def _pipeline_lines(result: Plan) -> list[str]:
    if result.stage_layers is None or result.bubble is None:
        return []
    stages = " | ".join(f"{r.start}..{r.stop - 1}" if len(r) > 1 else str(r.start) for r in result.stage_layers)
    return [
        f"pipeline: {len(result.stage_layers)} stages, layers {stages}; memory above is the busiest process's",
        f"pipeline bubble: {result.bubble:.1%} of each step idle",
    ]


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _spec(spec: PartitionSpec) -> str:
    return "[" + ", ".join("None" if axes is None else "+".join(axes) for axes in spec) + "]"


@dataclass
class PlanOptions:
    """The command-line options that size the plan but are not part of the experiment config."""

    batch: int = 1
    seq_len: Optional[int] = None
    devices: Optional[int] = None
    #: Search meshes for this cluster (``gpu-H100-8x32``, ``tpu-v5p-512``) instead of planning one.
    hardware: Optional[str] = None
    #: GiB per device: overrides the cluster's, or with ``devices`` alone searches an H100-class cluster.
    device_memory: Optional[float] = None
    #: Sequences per step for the search (default: one per device).
    global_batch: Optional[int] = None
    top: int = 5


def _positive_int(key: str) -> Callable[[str], int]:
    def parse(value: str) -> int:
        if not value.isdigit() or int(value) <= 0:
            raise ConfigError(key, value, "a positive integer")
        return int(value)

    return parse


def _gibibytes(value: str) -> float:
    number = value.removesuffix("GiB").removesuffix("GB")
    try:
        parsed = float(number)
    except ValueError:
        parsed = 0.0
    if parsed <= 0:
        raise ConfigError("device_memory", value, "a positive size in GiB, e.g. 80GiB")
    return parsed


_OPTION_PARSERS: dict[str, Callable[[str], Any]] = {
    "batch": _positive_int("batch"),
    "seq_len": _positive_int("seq_len"),
    "devices": _positive_int("devices"),
    "hardware": str,
    "device_memory": _gibibytes,
    "global_batch": _positive_int("global_batch"),
    "top": _positive_int("top"),
}


def split_plan_options(argv: Sequence[str]) -> tuple[list[str], PlanOptions]:
    """Separate the plan-only ``key=value`` options from the config overrides."""
    overrides, options = [], PlanOptions()
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in _OPTION_PARSERS:
            setattr(options, key, _OPTION_PARSERS[key](value))
        else:
            overrides.append(arg)
    return overrides, options


def load_plan_inputs(
    overrides: Sequence[str], devices: Optional[int] = None
) -> tuple[ExperimentConfig, dict[str, int]]:
    """Compose and validate the config as ``axtorch-train`` would, and resolve its mesh.

    The train-time checks assume the single backend's one-device mesh, so the mesh is set aside
    while they run and resolved here against ``devices`` (default: the product of its axes).
    """
    cfg = compose_experiment_config(overrides)
    mesh = to_object(cfg.mesh, MeshConfig)
    cfg.mesh = MeshConfig()
    config = to_experiment_config(cfg)
    config.mesh = mesh
    if devices is None and config.mesh_rules.hardware is not None:
        devices = device_count(config.mesh_rules.hardware)  # a mesh rule's target: its devices
    if devices is None:
        inferred = [axis for axis in MESH_AXES if getattr(mesh, axis) == -1]
        if inferred:
            raise ConfigError("devices", None, "the device count", reason=f"mesh.{inferred[0]}=-1 is inferred from it")
        devices = math.prod(getattr(mesh, axis) for axis in MESH_AXES)
    return config, mesh.resolve(devices, "mesh")


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``axtorch-plan``; returns 2 on a configuration error."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        return 0
    try:
        overrides, options = split_plan_options(argv)
        if options.hardware is not None or options.device_memory is not None:
            print(search_report(overrides, options))
            return 0
        config, mesh_sizes = load_plan_inputs(overrides, options.devices)
        result = plan(config, mesh_sizes, options.batch, options.seq_len)
    except ConfigError as error:
        print(f"axtorch-plan: {error}", file=sys.stderr)
        return 2
    print(format_plan(result))
    return 0


def search_report(overrides: Sequence[str], options: PlanOptions) -> str:
    """Search the meshes of ``options.hardware`` (or an H100-class cluster of ``devices``) and report the best."""
    from axtorch.cli.plan_search import Planner, cluster_for, format_candidates

    hardware = options.hardware
    if hardware is None:
        if options.devices is None:
            raise ConfigError("devices", None, "the device count, with device_memory= and no hardware=")
        per_host = math.gcd(options.devices, 8)
        hardware = f"gpu-H100-{per_host}x{options.devices // per_host}"
    cluster = cluster_for(hardware, options.device_memory)
    configs = {name: load_plan_inputs([*overrides, f"sharding={name}"])[0] for name in ("fsdp", "fsdp_tp", "fsdp_ep")}
    config = configs["fsdp"]
    seq_len = options.seq_len or config.data.seq_len
    planner = Planner(
        config,
        {name: each.sharding for name, each in configs.items()},
        cluster,
        seq_len,
        options.global_batch or cluster.devices,
    )
    return format_candidates(planner.search(), cluster, options.top)


if __name__ == "__main__":
    raise SystemExit(main())
