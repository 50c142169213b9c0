"""How one model splits over one mesh: each parameter's spec and shard, and what each device holds."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from axtorch.config.errors import ConfigError
from axtorch.layers.remat import RematConfig
from axtorch.parallel.backend_kind import BackendKind
from axtorch.parallel.sharding import PartitionSpec, auto_sharding_preset, resolve_parameter_specs, shard_shape
from axtorch.plan.memory import DeviceMemory, device_memory, native_fsdp_specs, parameter_elements, stage_layers
from axtorch.train.config import Precision
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.flops import active_parameters, layer_flops_per_token, model_flops_per_token


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
    memory: DeviceMemory
    batch_size: int
    seq_len: int
    #: The remat policy the activation estimate assumes: none, full or selective.
    remat: str
    flops_per_token: float
    #: ``trainer.precision``: the activations' bytes and the peak a step time would use.
    compute_precision: Precision
    #: The precision policy, as the run would apply it.
    precision: str
    #: The preset ``sharding=auto`` (the default) chose for the mesh; None where one was named.
    auto_sharding: Optional[str] = None
    #: Under ``mesh.pipe``: each stage's layers, and the share of a step the pipeline idles.
    stage_layers: Optional[list[range]] = None
    bubble: Optional[float] = None

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_sizes.values())


def plan(
    config: ExperimentConfig,
    mesh_sizes: Mapping[str, int],
    batch_size: int = 1,
    seq_len: Optional[int] = None,
) -> Plan:
    """Resolve ``config.sharding`` for ``config.model`` on ``mesh_sizes`` and size what each device holds.

    ``batch_size`` is sequences per device (per micro-batch under ``mesh.pipe``); ``seq_len``
    defaults to ``data.seq_len``. Raises ``ConfigError`` for rules that do not fit the model or mesh.
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
    if config.backend is BackendKind.native:
        specs = native_fsdp_specs(named_shapes, specs, mesh_sizes)
    pipe, pipeline = mesh_sizes.get("pipe", 1), config.pipeline
    layer_costs = layer_flops_per_token(model, seq_len)  # what pipeline stages balance, as a run's do
    microbatches = 1
    stages = bubble = None
    if pipe > 1:
        microbatches = pipeline.planned_microbatches(pipe)
        pipeline.validate(pipe, model.decoder.num_layers, microbatches)
        stages = stage_layers(layer_costs, pipe, pipeline)
        bubble = pipeline.bubble(pipe, microbatches)
    precision = config.trainer.precision
    return Plan(
        mesh_sizes=dict(mesh_sizes),
        parameters=_group_layers(named_shapes, specs, mesh_sizes),
        total_parameters=sum(math.prod(shape) for shape in named_shapes.values()),
        active_parameters=active_parameters(network),
        memory=device_memory(
            model,
            parameter_elements(named_shapes, specs, mesh_sizes, layer_costs, pipeline),
            mesh_sizes,
            precision,
            batch_size,
            seq_len,
            pipeline,
            layer_costs,
            microbatches,
            keeps_weights_gathered=config.backend is BackendKind.xla,
        ),
        batch_size=batch_size,
        seq_len=seq_len,
        remat=remat_name(model.decoder.remat),
        flops_per_token=model_flops_per_token(model, seq_len, network),
        compute_precision=precision,
        precision=describe_precision(config),
        auto_sharding=auto_sharding_preset(mesh_sizes) if config.sharding.auto else None,
        stage_layers=stages,
        bubble=bubble,
    )


def describe_precision(config: ExperimentConfig) -> str:
    """The precision policy the run applies, in words."""
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


def remat_name(remat: Optional[RematConfig]) -> str:
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
