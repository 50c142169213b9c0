"""The dry run of the xla backend: the real step traced by torch_xla and never run, its shardings
checked, and for a TPU slice compiled by the TPU compiler.

torch_xla records a step as a lazy graph and compiles and runs it only when a value is needed. The
dry run builds the model with every parameter a placeholder of its shape (an argument of the
program with no data behind it), annotated with the backend's own spec
(``XlaBackend.place_without_values``), makes AdamW's moments and the batch alike, and traces the
real training step (forward, loss, backward, clipping, AdamW) at the real layer count and shapes,
for the mesh's devices on a runtime of one virtual CPU device (so 128 devices or more trace as 8
do). It reads back the sharding each parameter, each moment and each annotated activation
carries in the traced program and holds it to what the rules ask.

Given a TPU topology it then hands the traced step, as one program, to the TPU compiler
(``axtorch.train.tpu_compiler``): the state and the batch are sharded arguments, the updated
state donated to the results. The trainer runs the same work as two programs (the gradients, whose
loss and norm it reads, then the update); in both the gradients live whole before the update, since
clipping needs their norm, so the one program's memory is the step's.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from axtorch.config.errors import ConfigError
from axtorch.layers.mixture_of_experts import routed_evenly
from axtorch.parallel.chips import GIB, TpuTopology
from axtorch.parallel.execution import LayerRunnerKind
from axtorch.parallel.sharding import PartitionSpec, resolve_activation_specs
from axtorch.parallel.xla import MOMENTS, XlaBackend, program_split, start_tracing_runtime  # needs torch_xla
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.optimizer import build_optimizer
from axtorch.train.step import TrainStep
from axtorch.train.tpu_compiler import CompiledStep, compile_program, topology_devices
from axtorch.train.trainer import build_parallel_model, rows_per_replica

#: A parameter no rule covers is replicated (``sharding.require_full_coverage=false``); above this
#: many bytes that is a finding: every device would hold it whole without anyone having asked.
UNASKED_REPLICATION_LIMIT = 2**20


@dataclass
class TracedSharding:
    """One tensor of the traced program: how the rules ask it split and how the program splits it."""

    kind: str  # "parameter", "AdamW moment" or "activation"
    name: str
    shape: tuple[int, ...]
    #: Ways each dimension is split, as the rules ask.
    asked: tuple[int, ...]
    #: Ways each dimension is split in the traced program; None: the program carries no annotation.
    traced: Optional[tuple[int, ...]]
    #: Bytes a device holds of it, as the program splits it.
    device_bytes: int
    #: What the program does otherwise than the rules ask; None where it does as they ask.
    problem: Optional[str] = None


@dataclass
class XlaDryRunReport:
    devices: int
    mesh: dict[str, int]
    tensors: list[TracedSharding]
    #: Activation rules' annotations the traced step never placed: inside a scan
    #: (``execution.layer_runner=scan``) the compiler propagates shardings from the stacked weights
    #: and the carry instead; elsewhere, a rule for a module the step does not call.
    unplaced: list[str] = dataclasses.field(default_factory=list)
    #: The step compiled by the TPU compiler for a topology (``hardware=v5p:4x4x4``); None: not compiled.
    compiled: Optional[CompiledStep] = None

    @property
    def problems(self) -> list[TracedSharding]:
        return [tensor for tensor in self.tensors if tensor.problem is not None]

    def device_bytes(self, kind: str) -> int:
        return sum(tensor.device_bytes for tensor in self.tensors if tensor.kind == kind)


def xla_dry_run(
    config: ExperimentConfig,
    mesh: dict[str, int],
    topology: Optional[TpuTopology] = None,
    compile_effort: float = 0.0,
) -> XlaDryRunReport:
    """Trace one training step of ``config`` on the xla backend over ``mesh``'s devices, without
    running it, and check the shardings it carries against the rules; given a TPU ``topology``,
    compile the traced step for it with the TPU compiler (``axtorch.train.tpu_compiler``).

    The step is traced on placeholders (no data) on a one-device runtime, annotated for the mesh's
    devices (``XlaBackend(traced_devices=...)``), so any device count traces in the same memory.
    ``compile_effort``: the TPU compiler's optimization effort (``compile_program``).
    """
    devices = math.prod(mesh.values())
    if topology is not None:  # before tracing: a mesh the slice cannot hold is refused at once
        chips = len(topology_devices(topology))
        if chips != devices:
            raise ConfigError(
                "mesh",
                " x ".join(f"{axis}={size}" for axis, size in mesh.items() if size > 1) or "one device",
                f"axes whose product is {chips}, the devices of {topology.name}",
                reason=f"the mesh has {devices} devices",
            )
    start_tracing_runtime()
    traced = copy.copy(config)
    traced.mesh = config.mesh.with_sizes(mesh)
    backend = XlaBackend(traced.mesh, traced.sharding, traced.execution, traced_devices=devices)
    model = build_parallel_model(traced, backend, fill=False)
    backend.place_without_values(model)
    specs, sizes = backend.parameter_specs, backend.sizes
    tensors = [
        _checked("parameter", name, param, specs[name], sizes, _covered(name, config))
        for name, param in model.named_parameters()
    ]
    optimizer = build_optimizer(model, config.optim)
    backend.annotate_optimizer_state(optimizer)
    state: list[torch.Tensor] = []  # what the step updates in place: trained parameters and their moments
    for name, param in model.named_parameters():
        for key in MOMENTS if param in optimizer.state else ():
            tensors.append(_checked("AdamW moment", f"{name}.{key}", optimizer.state[param][key], specs[name], sizes))
            state.append(optimizer.state[param][key])
        if param in optimizer.state:
            state.append(param)
    origins = [backend.tensor_id(tensor) for tensor in state]  # the placeholders they start as
    seen = _watch_activations(model, config, sizes)
    rows = rows_per_replica(config.trainer, backend.data_parallel_size)
    work = TrainStep(config, backend, model, config.loss.build(), optimizer, rows // config.trainer.grad_accum_steps)
    backend.runner.prepare(rows)
    tokens = torch.zeros(rows, config.data.seq_len, dtype=torch.long)
    with routed_evenly():  # a placeholder has no values for a router's counts to be read from
        loss, grad_norm = work.gradients({"input_ids": tokens, "labels": tokens.clone()})
    work.update(config.optim.lr)  # traced into the graph, which is never run
    unplaced = []
    for (module, io, field), (spec, calls) in seen.items():
        if not calls:
            unplaced.append(f"{module} {io}.{field}")
        for shape, ways, itemsize in calls[:1]:  # every call of a module annotates alike
            tensors.append(_activation(f"{module} {io}.{field}", shape, ways, itemsize, spec, sizes))
    report = XlaDryRunReport(devices, mesh, tensors, unplaced)
    if topology is not None:
        scanned = config.execution.layer_runner is LayerRunnerKind.scan
        report.compiled = _compile(backend, topology, [*state, loss, grad_norm], origins, compile_effort, scanned)
    return report


def _compile(
    backend: XlaBackend,
    topology: TpuTopology,
    results: list[torch.Tensor],
    origins: list[int],
    effort: float,
    scanned: bool,
) -> CompiledStep:
    """The traced step as one program for ``topology``: placeholders are sharded arguments, the
    updated state (``results`` before the loss and norm, each from the placeholder in ``origins``)
    sharded like them and donated to them, the loss and norm replicated."""
    program = backend.traced_program(results)
    arguments = {tensor_id: index for index, tensor_id in enumerate(program.argument_ids) if tensor_id is not None}
    shardings = backend.placeholder_shardings
    return compile_program(
        program.stablehlo,
        topology,
        [None if tensor_id is None else shardings.get(tensor_id) for tensor_id in program.argument_ids],
        [shardings[origin] for origin in origins] + ["{replicated}"] * (len(results) - len(origins)),
        {result: arguments[origin] for result, origin in enumerate(origins) if origin in arguments},
        effort,
        int64_as_int32=scanned,  # what libtpu 0.0.21 compiles the layer scan with (``compile_program``)
    )


def _ways(spec: PartitionSpec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(math.prod(sizes[axis] for axis in axes or ()) for axes in spec)


def _covered(name: str, config: ExperimentConfig) -> bool:
    return any(re.fullmatch(rule.pattern, name) for rule in config.sharding.parameters)


def _checked(
    kind: str, name: str, tensor: torch.Tensor, spec: PartitionSpec, sizes: Mapping[str, int], covered: bool = True
) -> TracedSharding:
    shape, asked, traced = tuple(tensor.shape), _ways(spec, sizes), program_split(tensor)
    split = traced if traced is not None else (1,) * len(shape)
    device_bytes = tensor.numel() * tensor.element_size() // math.prod(split)
    problem = None
    if split != asked:
        problem = f"the rules ask it split {_as_ways(asked)}, the program splits it {_as_ways(split)}"
    elif not covered and math.prod(split) == 1 and device_bytes >= UNASKED_REPLICATION_LIMIT:
        problem = (
            f"no rule covers it, so every device holds it whole ({device_bytes / 2**20:.1f} MiB): "
            "give it a rule (sharding.parameters), null entries if replicating it is meant"
        )
    return TracedSharding(kind, name, shape, asked, traced, device_bytes, problem)


def _activation(
    name: str,
    shape: tuple[int, ...],
    traced: Optional[tuple[int, ...]],
    itemsize: int,
    spec: PartitionSpec,
    sizes: Mapping[str, int],
) -> TracedSharding:
    asked = _ways(spec, sizes)
    split = traced if traced is not None else (1,) * len(shape)
    uneven = [(dim, size, ways) for dim, (size, ways) in enumerate(zip(shape, asked)) if size % ways]
    problem = None
    if split != asked:
        problem = f"the rules ask it split {_as_ways(asked)}, the program splits it {_as_ways(split)}"
    elif uneven:
        problem = (
            f"it does not split evenly ({', '.join(f'dim {d} of size {n} over {w}' for d, n, w in uneven)}): "
            f"the compiler pads every device's piece; {'; '.join(_evenly(d, n, w) for d, n, w in uneven)}"
        )
    return TracedSharding(
        "activation", name, shape, asked, traced, math.prod(shape) * itemsize // math.prod(split), problem
    )


def _evenly(dim: int, size: int, ways: int) -> str:
    """The change that splits an activation's ``dim`` evenly: its rows are a micro-batch's, its
    positions the sequence's (the layers' inputs and outputs, ``[rows, positions, ...]``)."""
    even = -(-size // ways) * ways
    if dim == 0:
        return f"{even} rows a micro-batch would (trainer.batch_size = {even} x trainer.grad_accum_steps)"
    if dim == 1:
        return f"data.seq_len={even} would"
    return f"a size of {even} would"


def _any_layer(name: str) -> str:
    """``decoder.layers.N.attention...`` for every layer's ``decoder.layers.7.attention...``."""
    return re.sub(r"\.\d+(\.|\s|$)", r".N\1", name)


def _as_ways(ways: tuple[int, ...]) -> str:
    return "x".join(str(count) for count in ways) if math.prod(ways) > 1 else "nowhere (replicated)"


def _watch_activations(
    model: nn.Module, config: ExperimentConfig, sizes: Mapping[str, int]
) -> dict[tuple[str, str, str], tuple[PartitionSpec, list[tuple[tuple[int, ...], Optional[tuple[int, ...]], int]]]]:
    """Record, for every activation a rule names, the shape and the program's split of each call's
    tensor, read after the backend's own hook has annotated it (hooks run in the order registered)."""
    modules = dict(model.named_modules())
    seen: dict = {}
    for (module_name, io, field), spec in resolve_activation_specs(modules, config.sharding, sizes).items():
        calls: list = []
        seen[module_name, io, field] = (spec, calls)

        def record(value: Any, calls: list = calls, field: str = field) -> None:
            tensor = getattr(value, field)
            if not is_fake(tensor):  # inside a scan's trace the backend places no annotation
                calls.append((tuple(tensor.shape), program_split(tensor), tensor.element_size()))

        module = modules[module_name]
        if io == "input":
            module.register_forward_pre_hook(lambda mod, args, record=record: record(args[0]))
        else:
            module.register_forward_hook(lambda mod, args, output, record=record: record(output))
    return seen


def format_xla_report(
    report: XlaDryRunReport, capacity_bytes: Optional[float] = None, hardware: Optional[str] = None
) -> str:
    """The XLA dry run as the command prints it: what the program splits, how, and what is wrong."""
    split = " ".join(f"{axis}={size}" for axis, size in report.mesh.items() if size != 1) or "one device"
    kinds = {
        kind: [t for t in report.tensors if t.kind == kind] for kind in ("parameter", "AdamW moment", "activation")
    }
    state = report.device_bytes("parameter") + report.device_bytes("AdamW moment")
    unit, scale = ("GiB", GIB) if state >= GIB else ("MiB", 2**20)
    lines = [
        f"dry run (xla): one step traced by torch_xla for {report.devices} devices (mesh {split}) and never "
        "run; no weights held, no data read, no checkpoint written",
        f"  parameters:     {len(kinds['parameter'])} in the program, "
        f"{report.device_bytes('parameter') / scale:.3f} {unit} a device as it splits them",
        f"  AdamW moments:  {len(kinds['AdamW moment'])}, "
        f"{report.device_bytes('AdamW moment') / scale:.3f} {unit} a device",
        f"  activations:    {len(kinds['activation'])} annotated by the rules"
        + (
            f"; not placed by the step (inside scanned layers, left to the compiler; or never called): "
            f"{', '.join(report.unplaced)}"
            if report.unplaced
            else ""
        ),
    ]
    # Modules that differ only in their index (every layer's output) annotate alike: one line for them.
    alike: dict[tuple[str, tuple[int, ...], str], int] = {}
    for tensor in kinds["activation"]:
        key = (_any_layer(tensor.name), tensor.shape, _as_ways(tensor.traced or (1,)))
        alike[key] = alike.get(key, 0) + 1
    for (name, shape, ways), count in alike.items():
        lines.append(f"    {name} {list(shape)} split {ways}" + (f" ({count} modules)" if count > 1 else ""))
    replicated = [t for t in kinds["parameter"] if math.prod(t.traced or (1,)) == 1]
    if replicated:
        held = sum(t.device_bytes for t in replicated)
        lines.append(f"  replicated parameters (as the rules ask): {len(replicated)}, {held / 2**20:.3f} MiB a device")
    problems = report.problems
    lines.append(
        "  every parameter, moment and annotated activation is split as the rules ask, at the real shapes"
        if not problems
        else f"  {len(problems)} tensor{'s' * (len(problems) != 1)} split otherwise than the rules ask:"
    )
    # One rule's problem repeats in every layer: one line for the modules that differ only in their index.
    grouped: dict[tuple[str, str, tuple[int, ...], str], int] = {}
    for tensor in problems:
        problem_key = (tensor.kind, _any_layer(tensor.name), tensor.shape, str(tensor.problem))
        grouped[problem_key] = grouped.get(problem_key, 0) + 1
    for (kind, name, shape, problem), count in list(grouped.items())[:20]:
        repeated = f" ({count} {'modules' if kind == 'activation' else 'tensors'})" if count > 1 else ""
        lines.append(f"    {kind} {name} {list(shape)}{repeated}: {problem}")
    if len(grouped) > 20:
        lines.append(f"    ... and {len(grouped) - 20} more")
    if report.compiled is not None:
        lines += format_compiled(report.compiled, state, capacity_bytes)
        return "\n".join(lines)
    lines.append(
        "  not seen without compiling (hardware=<a TPU topology> compiles it): activations' and temporaries' "
        "memory, the compiler's splits of unannotated tensors, the collectives (docs/parallelism.md)"
    )
    if capacity_bytes is not None:
        verdict = "fit" if state <= capacity_bytes else "do NOT fit"
        lines.append(
            f"the weights and AdamW state alone {verdict} {hardware or 'the device'}: {state / GIB:.2f} GiB "
            f"of {capacity_bytes / GIB:.2f} GiB a device (activations not counted)"
        )
    return "\n".join(lines)


def format_compiled(compiled: CompiledStep, state_bytes: int, capacity_bytes: Optional[float]) -> list[str]:
    """The TPU compiler's figures for the step, per chip, against the chip's memory."""

    unit, scale = ("GiB", GIB) if compiled.hbm_bytes >= GIB else ("MiB", 2**20)

    def gib(count: float) -> str:
        return f"{count / scale:9.3f} {unit}"

    lines = [
        f"compiled by the TPU compiler (libtpu {_libtpu_version()}) for {compiled.topology}: {compiled.devices} "
        f"{compiled.device_kind} devices, in {compiled.compile_seconds:.1f} s"
        + (f" at optimization effort {compiled.effort:g} (0 is the TPU's own compile)" if compiled.effort else "")
        + "; per device:",
        f"  arguments       {gib(compiled.argument_bytes)}  (parameters and AdamW moments as split, from their "
        f"shapes: {state_bytes / scale:.3f} {unit}; the rest is the batch, scalars and TPU layout padding)",
        f"  outputs         {gib(compiled.output_bytes)}  ({compiled.alias_bytes / scale:.3f} {unit} of them in the "
        f"arguments' buffers: {len(compiled.aliased)} updated tensors donated)",
        f"  temporaries     {gib(compiled.temporary_bytes)}",
        f"  generated code  {gib(compiled.code_bytes)}",
        f"  HBM the step needs {compiled.hbm_bytes / scale:.3f} {unit}"
        + (
            ""
            if capacity_bytes is None
            else f" of {capacity_bytes / GIB:.2f} GiB a device: "
            + ("fits" if compiled.hbm_bytes <= capacity_bytes else "does NOT fit")
        ),
        f"  FLOPs {compiled.flops:.4g}, bytes accessed {compiled.bytes_accessed:.4g} (the compiler's cost analysis)",
        "  collectives the partitioner inserted: "
        + (
            ", ".join(
                f"{c.kind} x{c.count} ({c.bytes / GIB:.3f} GiB)"
                for c in sorted(compiled.collectives.values(), key=lambda c: c.kind)
            )
            or "none"
        ),
        "  not checked by compiling: the step time, the network between hosts, the runtime (docs/parallelism.md)",
    ]
    if compiled.int64_as_int32:  # the layer scan's program (``compile_program``)
        lines[-1:-1] = [
            "  the layer scan: its loop's FLOPs, bytes and collectives are counted once, not once a layer; its "
            "64-bit integers (token ids, positions, indices) compiled as 32-bit ones, which libtpu 0.0.21 needs there"
        ]
    return lines


def _libtpu_version() -> str:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
