"""A dry run: the real training step, at the real size and world size, on fake tensors.

One process stands for one rank of a world of any size (``axtorch.parallel.fake_world``): torch's
``fake`` process-group backend answers every collective without peers, and ``FakeTensorMode``
gives every tensor its shape, dtype and device without memory. Under them the run's own code
builds the model, shards it with the native backend and the run's sharding rules, and runs
``TrainStep`` (forward, loss, backward, clipping, optimizer) as training does, while torch's
memory tracker (``memory_tracker``) sorts what each live tensor is, ``FlopCounterMode`` counts
the FLOPs and ``CollectiveLog`` the collectives. Nothing reads data or writes a checkpoint.

What it cannot see: the device's own allocator (fragmentation, caching, the CUDA context, NCCL's
buffers) and kernels' workspaces; it traces on the CPU, the same shapes a GPU run has.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

from axtorch.config.errors import ConfigError
from axtorch.layers.mixture_of_experts import routed_evenly
from axtorch.parallel.backend_kind import BackendKind
from axtorch.parallel.chips import GIB
from axtorch.parallel.fake_world import fake_world, memory_tracker
from axtorch.parallel.optimizer_state import create_adamw_state
from axtorch.parallel.tensor_shards import is_distributed
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.optimizer import build_optimizer
from axtorch.train.step import TrainStep
from axtorch.train.trainer import build_parallel_model, build_run_backend, rows_per_replica

if TYPE_CHECKING:  # imports torch._dynamo, which only pipelines need
    from axtorch.parallel.pipeline import Pipeline

#: The memory tracker's kinds of tensor (``_FSDPRefType`` / ``_RefType`` names), in the report's words.
_KINDS = {
    "sharded param": "parameters",
    "unsharded param": "parameters, gathered",
    "parameter": "parameters",
    "buffer": "parameters",
    "sharded grad": "gradients",
    "unsharded grad": "gradients, unsharded",
    "gradient": "gradients",
    "optstate": "optimizer state",
    "activation": "activations",
    "temp": "temporaries",
    "inputs": "temporaries",
    "other": "temporaries",
    "all gather": "collective buffers",
    "reduce scatter": "collective buffers",
}
KIND_ORDER = (
    "parameters",
    "parameters, gathered",
    "gradients",
    "gradients, unsharded",
    "optimizer state",
    "activations",
    "temporaries",
    "collective buffers",
)


def _addmm_flops(self_shape: Any, a_shape: Any, b_shape: Any, *_: Any, **__: Any) -> int:
    """``addmm_``'s product, as torch counts ``addmm``'s."""
    (m, k), (_, n) = a_shape, b_shape
    return 2 * m * k * n


def _attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *_: Any, **__: Any) -> int:
    """Scores and weighted values for every query head (key/value heads shared by groups of them)."""
    rows, heads, queries, width = query_shape
    return 2 * rows * heads * queries * key_shape[2] * (width + value_shape[3])


def _attention_backward_flops(
    grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *_: Any, **__: Any
) -> int:
    """The scores recomputed, then the gradients of the scores, values, queries and keys."""
    rows, heads, queries, width = query_shape
    return 2 * rows * heads * queries * key_shape[2] * (3 * width + 2 * value_shape[3])


#: FLOP formulas torch's counter lacks for kernels the trace meets on the CPU, where it counts their
#: CUDA counterparts: the in-place ``addmm_`` (the fused loss's head gradient) and the CPU flash
#: attention, forward and backward (as torch 2.13 counts attention, query heads sharing key/value
#: heads included, which torch 2.9's formulas refuse). Without them an 8B step counted 16% low.
_CPU_FLOP_FORMULAS = {
    torch.ops.aten.addmm_: _addmm_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
}


#: Collective ops by name (c10d's and the functional ones), as the report names them.
class _RankFlopCounter(FlopCounterMode):
    """FLOPs at the shapes this rank computes: a DTensor's operator (tensor parallelism's matmuls)
    reaches the counter at its global shapes, and runs on its local ones beyond the counter's sight,
    so it is counted at its local tensors'. Counted at the global shapes, an fsdp=2 x model=2 rank's
    step was 1.72x what torch's profiler measures a real one to run."""

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        def local(value: Any) -> Any:
            return value.to_local() if is_distributed(value) else value

        super()._count_flops(func_packet, *tree_map(local, (out, args, kwargs)))
        return out


_COLLECTIVES = {
    "all_reduce": "all-reduce",
    "allreduce": "all-reduce",
    "allgather": "all-gather",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "alltoall": "all-to-all",
    "all_to_all": "all-to-all",
    "broadcast": "broadcast",
    "send": "send",
    "recv": "recv",
}


@dataclass
class CollectiveCount:
    kind: str
    count: int = 0
    #: Per message, the larger of its input and output: the whole tensor an all-gather assembles,
    #: a reduce-scatter reduces, an all-reduce sums.
    bytes: int = 0
    #: The mesh axes its process group spans (``fsdp``, ``data+fsdp``, ``model``); empty for a
    #: group that is no set of mesh axes.
    axes: str = ""
    #: Processes in its group.
    group_size: int = 1

    @property
    def sent_bytes(self) -> float:
        """Bytes that leave this process under ring algorithms: 2 (n-1)/n of what an all-reduce
        sums, (n-1)/n of what an all-gather assembles, a reduce-scatter reduces or an all-to-all
        exchanges, all of what a send sends."""
        n = self.group_size
        if self.kind in ("send", "recv"):
            return float(self.bytes) if self.kind == "send" else 0.0
        share = (n - 1) / n if n > 1 else 0.0
        return self.bytes * share * (2 if self.kind == "all-reduce" else 1)


@dataclass
class RankTrace:
    """What one traced rank holds and does in a step."""

    rank: int
    #: The pipeline stages it runs (empty without ``mesh.pipe``).
    stages: list[int]
    #: Bytes live at the step's peak, by kind (``KIND_ORDER``).
    memory_at_peak: dict[str, int]
    collectives: list[CollectiveCount]
    flops: float

    @property
    def peak_bytes(self) -> int:
        return sum(self.memory_at_peak.values())

    @property
    def name(self) -> str:
        """``rank 2, stage 1`` (``rank 0`` without stages)."""
        stages = ", ".join(str(index) for index in self.stages)
        return f"rank {self.rank}" + (f", stage{'s' * (len(self.stages) > 1)} {stages}" if stages else "")


@dataclass
class DryRunReport:
    """The traced ranks' steps: rank 0, which stands for every rank of a mesh without ``pipe`` (they
    all hold the same shapes), or the first rank of each pipeline stage. Memory is the fullest
    rank's; FLOPs and collectives the busiest rank's, which sets the step's pace."""

    devices: int
    mesh: dict[str, int]
    steps: int
    ranks: list[RankTrace]

    @property
    def fullest(self) -> RankTrace:
        return max(self.ranks, key=lambda trace: trace.peak_bytes)

    @property
    def busiest(self) -> RankTrace:
        return max(self.ranks, key=lambda trace: trace.flops)

    @property
    def memory_at_peak(self) -> dict[str, int]:
        return self.fullest.memory_at_peak

    @property
    def peak_bytes(self) -> int:
        return self.fullest.peak_bytes

    @property
    def collectives(self) -> list[CollectiveCount]:
        return self.busiest.collectives

    @property
    def flops(self) -> float:
        return self.busiest.flops


class MeshGroups:
    """Names a process group by the mesh axes it spans, from this process's place in the mesh: a
    group of the ranks that differ from this one in axes A alone is named by A (``data+fsdp``)."""

    def __init__(self, mesh: Optional[DeviceMesh]) -> None:
        self.names: dict[frozenset[int], str] = {}
        coordinate = None if mesh is None else mesh.get_coordinate()
        if mesh is None or coordinate is None or mesh.mesh_dim_names is None:
            return
        ranks, names = mesh.mesh, mesh.mesh_dim_names
        varying = [dim for dim, size in enumerate(ranks.shape) if size > 1]
        for count in range(1, len(varying) + 1):
            for dims in itertools.combinations(varying, count):
                index = tuple(slice(None) if d in dims else coordinate[d] for d in range(ranks.dim()))
                self.names[frozenset(ranks[index].flatten().tolist())] = "+".join(names[d] for d in dims)

    def of(self, func: Any, args: Any, kwargs: Any) -> tuple[str, int]:
        """(axes, processes) of the group a collective op runs on; ("", 1) where it names none."""
        bound = dict(zip((a.name for a in func._schema.arguments), args)) | (kwargs or {})
        group = bound.get("process_group", bound.get("group_name"))
        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(cast(Any, group))  # a functional op's name
        elif group is not None and not isinstance(group, dist.ProcessGroup):
            group = dist.ProcessGroup.unbox(group)  # c10d's ops take it boxed
        if group is None:
            return "", 1
        ranks = frozenset(dist.get_process_group_ranks(group))
        return self.names.get(ranks, ""), len(ranks)


class CollectiveLog(TorchDispatchMode):
    """Counts the collectives a step issues, by kind and by the mesh axes of their group, with their
    bytes (``CollectiveCount.bytes``)."""

    def __init__(self, groups: MeshGroups) -> None:
        super().__init__()
        self.groups = groups
        self.counts: dict[tuple[str, str], CollectiveCount] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional") and (kind := _collective_kind(func.__name__)):
            axes, size = self.groups.of(func, args, kwargs)
            count = self.counts.setdefault((kind, axes), CollectiveCount(kind, axes=axes, group_size=size))
            count.count += 1
            tensors = [t for t in tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
            count.bytes += max((t.numel() * t.element_size() for t in tensors), default=0)
        return out


def _collective_kind(op_name: str) -> Optional[str]:
    name = op_name.split(".")[0]
    return next((kind for prefix, kind in _COLLECTIVES.items() if name.lstrip("_").startswith(prefix)), None)


def dry_run(config: ExperimentConfig, mesh: dict[str, int], steps: int = 1) -> DryRunReport:
    """Trace ``steps`` training steps of ``config`` on ``mesh``'s devices: as rank 0, or with
    ``mesh.pipe`` as the first rank of each stage, in the stages' order."""
    if config.backend is BackendKind.xla:
        raise ConfigError(
            "backend",
            "xla",
            "native or single with dry_run=true",
            reason="this traces the native backend's program; the xla backend's is axtorch.train.xla_dry_run "
            "(axtorch-train dry_run=true backend=xla)",
        )
    if steps < 1:
        raise ConfigError("steps", steps, "a positive number of steps to trace")
    devices = math.prod(mesh.values())
    # The native backend resolves the mesh against the fake world; the trace runs on the CPU. A
    # copy, not ``dataclasses.replace``: that would apply the deprecated settings again.
    traced = copy.copy(config)
    traced.backend = BackendKind.native
    traced.trainer = dataclasses.replace(config.trainer, device="cpu")
    # Every rank of a data x fsdp x model x seq x expert mesh holds the same shapes, so rank 0
    # stands for them all; with pipeline stages (``pipe``, the outermost axis) the first rank of
    # each, the first stage's first, since the others are handed the hidden states it hands on.
    ranks, handed_on = [], None
    stage_ranks = range(0, devices, devices // mesh["pipe"])
    for stage_rank in tqdm(
        stage_ranks, desc="tracing the pipeline's stages", unit="stage", disable=len(stage_ranks) == 1
    ):
        with fake_world(stage_rank, devices):
            trace, handed_on = _measure(traced, steps, handed_on=handed_on)
        ranks.append(trace)
    return DryRunReport(devices, mesh, steps, ranks)


def _measure(
    config: ExperimentConfig, steps: int, handed_on: Optional[torch.Tensor] = None
) -> tuple[RankTrace, Optional[torch.Tensor]]:
    """Memory at the peak by kind, and per step the collectives and FLOPs, of ``steps`` training
    steps on zero tokens, traced on fake tensors.
    Under ``mesh.pipe`` a trace gives its stages their shapes first (``Pipeline.shape_stages``:
    ``handed_on``, the hidden states the first stage hands on, which it returns)."""
    backend = build_run_backend(config)  # the device mesh is made outside fake mode: it reads its ranks
    groups = MeshGroups(getattr(backend, "mesh", None))  # and so are its groups' names
    rows = rows_per_replica(config.trainer, backend.data_parallel_size)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_parallel_model(config, backend, fill=False)
        optimizer = build_optimizer(model, config.optim)
        backend.prepare_optimizer(optimizer)
        # The optimizer state exists before the trace, as from the second step on: one traced
        # step is the steady state (tracing the step that creates it took as long again).
        create_adamw_state(optimizer)
        work = TrainStep(
            config, backend, model, config.loss.build(), optimizer, rows // config.trainer.grad_accum_steps
        )
        backend.runner.prepare(rows)
        tokens = torch.zeros(rows, config.data.seq_len, dtype=torch.long)
        batch = {"input_ids": tokens, "labels": tokens.clone()}
        stages: list[int] = []
        if not backend.runner.holds_whole_model:
            pipeline = cast("Pipeline", backend.runner)
            stages = pipeline.stage_indices
            with routed_evenly():  # the fake world's peers do not answer: the trace gives the stages their shapes
                handed_on = pipeline.shape_stages(work.micro_batches(batch)[0], work, handed_on)
        tracker = memory_tracker(model, optimizer, batch)
        collectives = CollectiveLog(groups)
        # Routing is data: fake tensors have none, so experts take their rows evenly.
        with (
            tracker,
            _RankFlopCounter(display=False, custom_mapping=_CPU_FLOP_FORMULAS) as flops,
            collectives,
            routed_evenly(),
        ):
            for _ in range(steps):
                work.gradients(batch)
                work.update(config.optim.lr)
                tracker.reset_mod_stats()
        at_peak = tracker.get_tracker_snapshot("peak")
    per_step = [c for _, c in sorted(collectives.counts.items())]
    counts = [dataclasses.replace(c, count=c.count // steps, bytes=c.bytes // steps) for c in per_step]
    rank = dist.get_rank() if dist.is_initialized() else 0
    return RankTrace(rank, stages, _by_kind(at_peak), counts, flops.get_total_flops() / steps), handed_on


def _by_kind(snapshot: dict[torch.device, dict[Any, int]]) -> dict[str, int]:
    """The tracker's peak snapshot, all devices together, in the report's kinds (``KIND_ORDER``)."""
    totals = dict.fromkeys(KIND_ORDER, 0)
    for per_kind in snapshot.values():
        for key, size in per_kind.items():
            name = str(getattr(key, "value", key)).lower()
            if name in _KINDS:
                totals[_KINDS[name]] += size
    return dict(totals)


def format_report(report: DryRunReport, capacity_bytes: Optional[float] = None, hardware: Optional[str] = None) -> str:
    """The report as the command prints it: memory by kind per traced rank, collectives, FLOPs, the fit."""
    split = " ".join(f"{axis}={size}" for axis, size in report.mesh.items() if size != 1) or "one device"
    lines = [
        f"dry run: {report.devices} devices (mesh {split}), {report.steps} step{'s' * (report.steps != 1)} traced "
        "on fake tensors (the optimizer state made first), the real program on torch's fake process group; "
        "no data read, no checkpoint written",
    ]
    unit, scale = ("GiB", GIB) if report.peak_bytes >= GIB else ("MiB", 2**20)
    if len(report.ranks) == 1:
        lines.append(f"rank 0 (every rank holds the same shapes), {unit} at the step's peak:")
        columns = [""]
    else:
        lines.append(
            f"the first rank of each pipeline stage (the other ranks of a stage hold the same shapes), "
            f"{unit} at the step's peak:"
        )
        columns = [f"{trace.name:>22}" for trace in report.ranks]
        lines.append(f"  {'':<22} {''.join(columns)}")
    width = max(len(column) for column in columns) or 10
    for kind in KIND_ORDER:
        values = "".join(f"{trace.memory_at_peak[kind] / scale:{width}.3f}" for trace in report.ranks)
        lines.append(f"  {kind:<22} {values}")
    lines.append(f"  {'peak':<22} {''.join(f'{trace.peak_bytes / scale:{width}.3f}' for trace in report.ranks)}")
    for trace in report.ranks:
        whose = "" if len(report.ranks) == 1 else f" ({trace.name})"
        sent = ", ".join(
            f"{c.kind}{f' over {c.axes}' if c.axes else ''} x{c.count} ({c.bytes / scale:.3f} {unit})"
            for c in trace.collectives
        )
        lines.append(f"  collectives per step{whose}: {sent or 'none'}")
        lines.append(f"  FLOPs per step{whose}: {trace.flops:.4g}")
    if capacity_bytes is not None:
        verdict = "fits" if report.peak_bytes <= capacity_bytes else "does NOT fit"
        lines.append(
            f"{verdict} {hardware or 'the device'}: peak {report.peak_bytes / GIB:.2f} GiB "
            f"of {capacity_bytes / GIB:.2f} GiB a device"
        )
    return "\n".join(lines)
