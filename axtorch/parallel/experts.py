"""Expert parallelism for the native backend: each process of an ``expert`` group holds some experts.

The ``expert`` axis is data-parallel outside the experts: its processes take different rows of
the batch and route their own tokens. A mixture-of-experts layer then hands its rows, sorted by
expert, to ``ExpertParallelCompute``, which sends each row to the process that holds its expert
(an all-to-all with uneven splits), runs the local experts there, and sends the outputs back
(a second all-to-all). Both exchanges carry gradients, so backward runs the same route reversed.
Dropless routing is per token, so the losses equal one device's. A layer's local experts are
gathered whole for its forward and again for its backward, so that at most one layer's are held
(``_RegatheredInBackward``). With a capacity, each process
fills its experts' buffers from its own rows, as every data-parallel replica does: the capacity
counts a process's tokens, like one device's micro-batch of those rows (the xla backend, one
program over the global batch, counts the whole batch instead).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from axtorch.layers.mixture_of_experts import GroupedExperts, even_counts, gated_mlp, routing_is_even


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _RegatheredInBackward:
    """Saved-tensor hooks under which autograd keeps no view of this process's gathered experts.

    The expert products save their weights for the backward; kept, every layer's gathered experts
    would stay from its forward to its backward (21 GiB a device for mixtral_8x7b at fsdp=8 x
    expert=8). Packed instead as where the view sits in its weight, they are gathered again when
    the backward first needs one of them, once for all their views, and dropped after the last:
    a second all-gather of each layer's experts, as FSDP's backward does for every other weight.
    """

    def __init__(self, gathered: list[torch.Tensor], gather: Callable[[int], torch.Tensor]):
        # A view is found again in a contiguous copy of its base, so only a contiguous base is let go;
        # and only weakly referenced here, since the backward's graph holds these hooks.
        roots = [tensor if tensor._base is None else tensor._base for tensor in gathered]
        self.roots = [weakref.ref(root) if root.is_contiguous() else None for root in roots]
        self.gather = gather
        self.pending: Counter[int] = Counter()
        self.regathered: dict[int, torch.Tensor] = {}

    def installed(self) -> contextlib.AbstractContextManager[Any]:
        """These hooks, or none inside a remat region: checkpoint's own saved-tensor hooks keep
        nothing for the backward, which runs the forward again, gathers included, and hooks of
        ours would keep what they drop."""
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        for index, root_ref in enumerate(self.roots):
            root = None if root_ref is None else root_ref()
            if root is not None and (tensor is root or tensor._base is root):
                self.pending[index] += 1
                offset = tensor.storage_offset() - root.storage_offset()
                return index, tuple(tensor.shape), tensor.stride(), offset
        return tensor

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        index, shape, stride, offset = packed
        if index not in self.regathered:
            with torch.no_grad():
                self.regathered[index] = self.gather(index)
        whole = self.regathered[index]
        self.pending[index] -= 1
        if not self.pending[index]:
            del self.regathered[index]
        return whole.as_strided(shape, stride, whole.storage_offset() + offset)


def _exchange(rows: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows ``send[p]`` at a time to each process ``p``; ``receive[p]`` rows back from each, with autograd."""
    out = rows.new_empty(sum(receive), rows.shape[1])
    return all_to_all_single(out, rows.contiguous(), receive, send, group=group)


class ExpertParallelCompute:
    """An ``ExpertCompute`` (a mixture of experts' seam) for experts split over the ``expert`` axis of ``mesh``.

    ``mesh`` is (``data``, ``fsdp``, ``expert``); the stacked expert weights are DTensors on it,
    split over ``expert`` on their first dimension and possibly over ``fsdp``. Each forward
    gathers this process's experts whole; their gradients come back summed over ``data`` and
    ``fsdp`` (reduce-scattered to the weights' layout) and multiplied by ``gradient_scale``, which
    cancels the trainer's loss scale as FSDP's averaging does for the other weights.
    """

    def __init__(self, mesh: DeviceMesh, gradient_scale: float):
        self.mesh = mesh
        self.group = mesh.get_group("expert")
        self.size = dist.get_world_size(self.group)
        self.gradient_scale = gradient_scale

    def __call__(self, experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor | int) -> torch.Tensor:
        local = experts.config.num_experts // self.size
        incoming_counts, send = self._splits(counts, local, rows.shape[0])
        receive = [sum(row) for row in incoming_counts]
        received = _exchange(rows, send, receive, self.group)
        # Received rows come by sender, then by expert; the experts want them by expert, then by sender.
        starts = [
            sum(receive[:sender]) + sum(incoming_counts[sender][:e])
            for sender in range(self.size)
            for e in range(local)
        ]
        order = torch.cat(
            [
                torch.arange(starts[sender * local + e], starts[sender * local + e] + incoming_counts[sender][e])
                for e in range(local)
                for sender in range(self.size)
            ]
        ).to(rows.device)
        stacked = [cast(DTensor, w) for w in (experts.gate_proj, experts.up_proj, experts.down_proj)]
        weights = [self._local(weight) for weight in stacked]
        per_expert = [sum(incoming_counts[sender][e] for sender in range(self.size)) for e in range(local)]
        by_expert = received[order].split(per_expert)
        hooks = _RegatheredInBackward(weights, lambda index: self._gather(stacked[index]).to_local().contiguous())
        with hooks.installed():
            outputs = [
                gated_mlp(group, weights[0][e], weights[1][e], weights[2][e], experts.config.activation)
                for e, group in enumerate(by_expert)
            ]
        computed = torch.cat(outputs) if outputs else received[:0]
        back = torch.empty_like(computed).index_copy(0, order, computed)
        return _exchange(back, receive, send, self.group)

    def _splits(self, counts: torch.Tensor | int, local: int, rows: int) -> tuple[list[list[int]], list[int]]:
        """How many rows every process sends each of this process's experts ([processes][local
        experts]), and how many this process sends each process; read once on the host. Under
        ``routed_evenly`` every process splits its ``rows`` evenly over all the experts."""
        if isinstance(counts, int):  # a capacity's buffer: every process sends every expert that many rows
            return [[counts] * local] * self.size, [counts * local] * self.size
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)  # under routed_evenly too: a dry run counts it
        if routing_is_even():
            per_expert = even_counts(rows, local * self.size)
            rank = dist.get_rank(self.group)
            mine = per_expert[rank * local : (rank + 1) * local]
            return [mine] * self.size, [sum(per_expert[p * local : (p + 1) * local]) for p in range(self.size)]
        return incoming.view(self.size, local).tolist(), counts.view(self.size, local).sum(1).tolist()

    def _gather(self, weight: DTensor) -> DTensor:
        """This process's experts of a stacked weight, whole: replicated over ``data`` and ``fsdp``."""
        return weight.redistribute(self.mesh, [Replicate(), Replicate(), Shard(0)])

    def _local(self, weight: DTensor) -> torch.Tensor:
        """This process's experts, whole, of a stacked weight; their gradient summed and scaled."""
        local = self._gather(weight).to_local(grad_placements=[Partial(), Partial(), Shard(0)])
        return _ScaleGradient.apply(local, self.gradient_scale)
