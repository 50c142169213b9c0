"""A dry run: the real training step, at the real size and world size, on fake tensors.

One process stands for one rank of a world of any size: torch's ``fake`` process-group backend
answers every collective without peers, and ``FakeTensorMode`` gives every tensor its shape,
dtype and device without memory. Under them the run's own code builds the model, shards it with
the native backend and the run's sharding rules, and runs ``TrainStep`` (forward, loss, backward,
clipping, optimizer) as training does, while torch's memory tracker (``FSDPMemTracker`` with
FSDP, ``MemTracker`` without) sorts what each live tensor is, ``FlopCounterMode`` counts the
FLOPs and ``CollectiveLog`` the collectives. Nothing reads data or writes a checkpoint.

What it cannot see: the device's own allocator (fragmentation, caching, the CUDA context, NCCL's
buffers) and kernels' workspaces; it traces on the CPU, the same shapes a GPU run has.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from axtorch.config.errors import ConfigError
from axtorch.parallel.backend_kind import BackendKind
from axtorch.parallel.chips import GIB
from axtorch.parallel.mesh import MESH_AXES
from axtorch.train.experiment import ExperimentConfig
from axtorch.train.optimizer import build_optimizer
from axtorch.train.step import TrainStep

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
#: Mesh axes the dry run does not trace yet (``dry_run`` refuses them).
UNTRACED_AXES = ("model", "seq", "expert", "pipe")
#: Collective ops by name (c10d's and the functional ones), as the report names them.
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


@dataclass
class RankReport:
    """One traced rank's step: memory at its peak by kind, and per step its collectives and FLOPs."""

    rank: int
    #: Bytes live at the step's peak, by kind (``KIND_ORDER``).
    memory_at_peak: dict[str, int]
    peak_bytes: int
    collectives: list[CollectiveCount]
    flops: float


@dataclass
class DryRunReport:
    devices: int
    mesh: dict[str, int]
    steps: int
    ranks: list[RankReport] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max(rank.peak_bytes for rank in self.ranks)


class CollectiveLog(TorchDispatchMode):
    """Counts the collectives a step issues, by kind, with their bytes (``CollectiveCount.bytes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, CollectiveCount] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional") and (kind := _collective_kind(func.__name__)):
            count = self.counts.setdefault(kind, CollectiveCount(kind))
            count.count += 1
            count.bytes += max((t.numel() * t.element_size() for t in _tensors((args, out))), default=0)
        return out


def _collective_kind(op_name: str) -> Optional[str]:
    name = op_name.split(".")[0]
    return next((kind for prefix, kind in _COLLECTIVES.items() if name.lstrip("_").startswith(prefix)), None)


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` on torch's ``fake`` process group, for the block."""
    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group (run it outside torchrun)")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


#: The context torch 2.10+ enters around DTensor's shape propagation (``_shapes_propagated_apart``).
_PROPAGATION_LOCK = "_fake_mode_lock"


@contextlib.contextmanager
def _shapes_propagated_apart() -> Iterator[None]:
    """DTensor's shape propagation in a fake mode of its own, as torch 2.9 does it.

    Newer torch propagates in the active fake mode, where the memory tracker cannot tell the
    global-shaped tensors of propagation from the step's own, and counts an 8B model's optimizer
    step at 85 GiB a rank instead of 1. ``_PROPAGATION_LOCK`` is the context torch enters around
    propagation (absent before 2.10, where setting it does nothing).
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    class FreshFakeMode:
        def __enter__(self) -> None:
            self.mode = FakeTensorMode(allow_non_fake_inputs=True)
            self.mode.__enter__()

        def __exit__(self, *exc: Any) -> None:
            self.mode.__exit__(*exc)

    had = _PROPAGATION_LOCK in vars(ShardingPropagator)
    former = vars(ShardingPropagator).get(_PROPAGATION_LOCK)
    setattr(ShardingPropagator, _PROPAGATION_LOCK, FreshFakeMode())
    try:
        yield
    finally:
        if had:
            setattr(ShardingPropagator, _PROPAGATION_LOCK, former)
        else:
            delattr(ShardingPropagator, _PROPAGATION_LOCK)


def _product(mesh: dict[str, int]) -> int:
    total = 1
    for axis in MESH_AXES:
        total *= mesh[axis]
    return total


def dry_run(config: ExperimentConfig, mesh: dict[str, int], steps: int = 2) -> DryRunReport:
    """Trace ``steps`` training steps of ``config`` as rank 0 of ``mesh``'s devices."""
    if config.backend is BackendKind.xla:
        raise ConfigError(
            "backend",
            "xla",
            "native or single with dry_run=true",
            reason="the dry run traces the native backend's program; an XLA mesh's memory comes from axtorch-plan",
        )
    if steps < 1:
        raise ConfigError("steps", steps, "a positive number of steps to trace")
    for axis in UNTRACED_AXES:
        if mesh[axis] > 1:
            raise ConfigError(
                f"mesh.{axis}",
                mesh[axis],
                "1 with dry_run=true",
                reason="the dry run traces meshes of the data and fsdp axes so far: tensor, sequence, expert "
                "and pipeline parallelism build their shards with device-mesh operations that fake tensors "
                "cannot run yet",
            )
    devices = _product(mesh)
    # The native backend resolves the mesh against the fake world; the trace runs on the CPU.
    traced = dataclasses.replace(config, backend=BackendKind.native)
    traced.trainer = dataclasses.replace(config.trainer, device="cpu")
    report = DryRunReport(devices, mesh, steps)
    # Every rank of a data x fsdp mesh holds the same shapes: rank 0 stands for them all.
    with fake_world(0, devices), _shapes_propagated_apart():
        report.ranks.append(_trace_rank(traced, 0, steps))
    return report


def _trace_rank(config: ExperimentConfig, rank: int, steps: int) -> RankReport:
    from axtorch.train.trainer import _build_backend, _rows_per_replica, build_parallel_model

    backend = _build_backend(config)  # the device mesh is made outside fake mode: it reads its ranks
    rows = _rows_per_replica(config.trainer, backend.data_parallel_size)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_parallel_model(config, backend, fill=False)
        optimizer = build_optimizer(model, config.optim)
        backend.prepare_optimizer(optimizer)
        work = TrainStep(
            config, backend, model, config.loss.build(), optimizer, rows // config.trainer.grad_accum_steps
        )
        backend.runner.prepare(rows)
        tokens = torch.zeros(rows, config.data.seq_len, dtype=torch.long)
        batch = {"input_ids": tokens, "labels": tokens.clone()}
        tracker: FSDPMemTracker | MemTracker
        if isinstance(model, FSDPModule):
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((batch,))
        else:
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
        collectives = CollectiveLog()
        with tracker, FlopCounterMode(display=False) as flops, collectives:
            for _ in range(steps):
                work.gradients(batch)
                work.update(config.optim.lr)
                tracker.reset_mod_stats()
        at_peak = tracker.get_tracker_snapshot("peak")
    memory = _by_kind(at_peak)
    per_step = sorted(collectives.counts.items())
    counts = [CollectiveCount(kind, c.count // steps, c.bytes // steps) for kind, c in per_step]

    return RankReport(rank, memory, sum(memory.values()), counts, flops.get_total_flops() / steps)


def _by_kind(snapshot: dict[torch.device, dict[Any, int]]) -> dict[str, int]:
    """The tracker's peak snapshot, all devices together, in the report's kinds (``KIND_ORDER``)."""
    totals: Counter[str] = Counter({kind: 0 for kind in KIND_ORDER})
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
        f"dry run: {report.devices} devices (mesh {split}), {report.steps} steps traced on fake tensors, "
        "the real program on torch's fake process group; no data read, no checkpoint written",
    ]
    unit, scale = ("GiB", GIB) if report.peak_bytes >= GIB else ("MiB", 2**20)
    for rank in report.ranks:
        lines.append(f"rank {rank.rank} (every rank holds the same shapes), {unit} at the step's peak:")
        for kind in KIND_ORDER:
            lines.append(f"  {kind:<22} {rank.memory_at_peak.get(kind, 0) / scale:10.3f}")
        lines.append(f"  {'peak':<22} {rank.peak_bytes / scale:10.3f}")
        sent = ", ".join(f"{c.kind} x{c.count} ({c.bytes / scale:.3f} {unit})" for c in rank.collectives)
        lines.append(f"  collectives per step: {sent or 'none'}")
        lines.append(f"  FLOPs per step: {rank.flops:.4g}")
    if capacity_bytes is not None:
        verdict = "fits" if report.peak_bytes <= capacity_bytes else "does NOT fit"
        lines.append(
            f"{verdict} {hardware or 'the device'}: peak {report.peak_bytes / GIB:.2f} GiB "
            f"of {capacity_bytes / GIB:.2f} GiB a device"
        )
    return "\n".join(lines)
