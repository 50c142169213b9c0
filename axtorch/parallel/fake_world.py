"""A fake world for the native backend: one process as any rank of any world size, on fake tensors.

A dry run (``axtorch.train.dry_run``) builds and runs the real program here: torch's ``fake``
process-group backend answers every collective without peers; the memory trackers of
``torch.distributed._tools`` sort the live tensors of FSDP's program (or of a plain one) by kind.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, cast
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import _disable_current_modes


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` on torch's ``fake`` process group, for the block,
    with DTensor's shape propagation kept apart from the traced program (``_shapes_propagated_apart``)."""
    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group (run it outside torchrun)")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=dist.HashStore())
    _forget_cached_shardings()
    try:
        with _shapes_propagated_apart(), _meshes_made_of_real_tensors():
            yield
    finally:
        dist.destroy_process_group()
        _forget_cached_shardings()


def _forget_cached_shardings() -> None:
    """Empty DTensor's cache of each op's output sharding, kept by its inputs' specs.

    A device mesh equals one of the same layout from another world (a dry run traces one rank
    of each pipeline stage in turn), whatever its process groups: a cached answer would carry
    the earlier world's groups, destroyed with it.
    """
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:  # torch 2.10 on: a second cache in C++
        clear_fast_path()


@contextlib.contextmanager
def _shapes_propagated_apart() -> Iterator[None]:
    """DTensor's shape propagation outside the traced program's modes, in a fake mode of its own.

    Propagation runs each op again at the global shapes. From 2.10 torch runs it in the active fake
    mode (the one ``detect_fake_mode`` finds), and 2.11's memory tracker counts what it makes in
    any mode (2.13's skips other modes' ops): AdamW's foreach update held about three global copies
    of the weights, an 8B model's step 85 GiB a rank instead of 1. With no mode active propagation
    makes its own, as 2.9 does, and neither the tracker, the FLOP counter nor the collective log sees it.
    """
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    @functools.wraps(propagate)
    def apart(self: ShardingPropagator, op_schema: Any) -> Any:
        with _disable_current_modes():
            return propagate(self, op_schema)

    with mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached", apart):
        yield


#: DeviceMesh's methods that make a mesh: its constructor, a slice of its axes, a flattened one.
_MESH_MAKERS = ("__init__", "__getitem__", "_flatten")


@contextlib.contextmanager
def _meshes_made_of_real_tensors() -> Iterator[None]:
    """Device meshes made inside the traced program (a 2-D FSDP mesh joined from the fsdp and
    model axes, a flattened one) hold their layout in real tensors, as outside fake mode.

    A mesh is a small table of ranks, not part of the step's memory; under fake mode its
    constructor has no values to find this rank's coordinates with (``nonzero``, ``tolist``).
    """
    from torch.distributed.device_mesh import DeviceMesh

    def with_real_tensors(make: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(make)
        def made(self: DeviceMesh, *args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return make(self, *args, **kwargs)

        return made

    with contextlib.ExitStack() as patches:
        for name in _MESH_MAKERS:
            patches.enter_context(mock.patch.object(DeviceMesh, name, with_real_tensors(getattr(DeviceMesh, name))))
        yield


class _NoHook:
    """Stands in the tracker's table for the gradient hook a frozen parameter cannot take."""

    def remove(self) -> None:
        pass


class _StepTracking:
    """torch's memory tracker, made to follow a step as axtorch runs it.

    A pipeline's schedule calls each stage's module once per micro-batch, as gradient accumulation
    calls the model; the tracker takes a second call of a module called from no other for the
    next step and refuses it. Its statistics per module (which the dry run does not read) then
    start again for that module; what the step holds, and its peak, are tracked as before. And the
    tracker hooks every parameter's gradient, which a frozen one (an adapter's base) has not.
    """

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        tracker = cast(MemTracker, self)
        modules = tracker._mod_tracker
        called_directly = modules.parents <= {"Global", modules.get_known_fqn(module)}
        if module in tracker.memory_tracking and called_directly and not modules.is_bw:
            del tracker.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)  # type: ignore[misc]

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        hooks = cast(MemTracker, self)._param_to_grad_hook_handles
        for param in module.parameters():
            if not param.requires_grad:
                hooks.setdefault(param, (_NoHook(), _NoHook()))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)  # type: ignore[misc]


class _StepFSDPMemTracker(_StepTracking, FSDPMemTracker):
    def track_parameters_fsdp_ignores(self, model: nn.Module) -> None:
        """Count as sharded parameters those FSDP leaves alone (expert parallelism's, split over
        axes of their own): FSDP's tracker finds its own alone, and its ``track_external`` does
        nothing, so without this the experts' shards were in no kind (1.2 MB of a 5.9 MB rank of
        ``mixtral_tiny`` counted; tests/parallel/test_dry_run_vs_gloo.py measures the real step).
        FSDP's own are counted once: a storage already tracked keeps its one entry."""
        for param in model.parameters():
            self._update_and_maybe_create_winfos(param, _FSDPRefType.SHARDED_PARAM)


class _StepMemTracker(_StepTracking, MemTracker):
    pass


def memory_tracker(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Any) -> FSDPMemTracker | MemTracker:
    """torch's tracker of the memory a step holds, by kind: FSDP's for a sharded model, else the plain one
    (either following a step as axtorch runs it: ``_StepTracking``)."""
    if isinstance(model, FSDPModule):
        tracker = _StepFSDPMemTracker(model, optimizer)
        tracker.track_inputs((inputs,))
        tracker.track_parameters_fsdp_ignores(model)
        return tracker
    plain = _StepMemTracker()
    plain.track_external(model, optimizer)
    return plain
