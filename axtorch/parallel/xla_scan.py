"""Scanned decoder layers on the xla backend (``execution.layer_runner=scan``): compile time flat in depth.

A scan compiles one step and loops it over weights stacked on a leading dimension. A step is one
repeated group of layers: one layer for a uniform stack, one period of the pattern for a
heterogeneous one (``DecoderConfig.period()``: local, local, global), whose layers differ but
whose groups do not. Layers left over after the last whole group run unrolled.
What else in a training step touches every layer's parameters separately would still grow the
programs with depth, so this module keeps those out of them too:

* the gradients stay stacked: the gradient norm reads the stacked weights' gradients (a few
  reductions, not one per layer), and the step's program writes no per-layer gradient out;
* the optimizer updates one group at a time, the same program for every group, compiled once:
  it takes the group's gradient from the stacked one at an index held on the device (a slice at
  a Python index would be baked into each group's program, making them all different).

Imported only by the xla backend: it needs torch_xla.
"""

from __future__ import annotations

import copy
import functools
import math
import operator
from collections.abc import Callable, Iterable
from typing import Optional

import torch
import torch_xla
from functorch.compile import default_partition, min_cut_rematerialization_partition
from torch import nn
from torch_xla.experimental.scan import scan

from axtorch.layers.transformer import Decoder, DecoderInput, TransformerLayerInput, add_aux_loss, run_layers_unrolled

#: A stacked weight: (its decoder's id, the parameter's name within a group, ``layers.{j}.<name>``).
StackKey = tuple[int, str]
#: Where a scanned layer's parameter sits: (decoder, stacked name, group index).
Slot = tuple[int, str, int]
#: One group's slice of the stacked weights and buffers, by name within the group.
_GroupWeights = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
#: What the scan runs per group: (carry, the group's weights) -> (carry, no per-step output).
_GroupStep = Callable[[tuple[torch.Tensor, ...], _GroupWeights], tuple[tuple[torch.Tensor, ...], None]]


class _ScanStep(nn.Module):
    """One group of consecutive decoder layers as a function of the scan carry
    ``(hidden_states, positions, aux_loss[, segment_ids])``.

    Positions, and the segment ids of packed documents, travel as float32 (exact below 2**24),
    since scan's carry must be differentiable; every step hands them on unchanged. Without
    segment ids the carry has no fourth part, so unpacked rows keep the fused causal kernel.
    """

    def __init__(self, layers: Iterable[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        aux_loss: torch.Tensor,
        segment_ids: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, ...]:
        long_positions = positions.long()
        long_segments = None if segment_ids is None else segment_ids.long()
        for layer in self.layers:
            out = layer(TransformerLayerInput(hidden_states, long_positions, segment_ids=long_segments))
            hidden_states, aux_loss = out.hidden_states, add_aux_loss(aux_loss, out.aux_loss)
        handed_on = () if segment_ids is None else (segment_ids.clone(),)
        return hidden_states, positions.clone(), aux_loss, *handed_on


class LayerScan:
    """The ``LayerRunner`` the xla backend fills decoders' seam with, its gradient norm and update.

    It stacks a decoder's repeated groups of layers (``DecoderConfig.period()`` layers each, with
    the same configs in the same order), so one group is traced and compiled whatever the depth.

    Each training forward's stacked weights keep their gradients (``retain_grad``): summed over
    the step's micro-batches, they are the groups' gradients, stacked.
    """

    def __init__(self, cut: Callable[[], None] = torch_xla.sync) -> None:
        """``cut``: what ends one update's program and runs it (the backend's ``run_traced``)."""
        self.cut = cut
        self.stacks: list[dict[StackKey, torch.Tensor]] = []  # this step's training forwards
        self.slots: dict[nn.Parameter, Slot] = {}  # the scanned layers' parameters
        self._templates: dict[int, _ScanStep] = {}  # per decoder: the layer the scan traces
        self._group_steps: dict[tuple[int, bool, tuple[bool, ...]], _GroupStep] = {}  # see _group_step
        self._stacked_grads: dict[StackKey, torch.Tensor] = {}  # clipped, until the update
        self._indices: dict[int, torch.Tensor] = {}  # group index -> the same on the device

    def __call__(self, decoder: Decoder, inputs: DecoderInput) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run ``decoder``'s groups of layers as one compiled loop over their stacked weights,
        then the layers after the last whole group one by one.

        The decoder's remat policy becomes AOTAutograd's min-cut rematerialisation of the scanned
        group (``torch.utils.checkpoint`` does not apply inside a traced scan body). A decode step
        with KV caches runs unrolled: the scan's carry holds no per-layer caches.
        """
        period = decoder.config.period()
        num_groups = len(decoder.layers) // period
        if inputs.kv_caches is not None or num_groups == 0:
            return run_layers_unrolled(decoder, inputs)
        hidden_states, positions = inputs.hidden_states, inputs.positions
        groups = [_ScanStep(decoder.layers[g * period : (g + 1) * period]) for g in range(num_groups)]
        parameters = [dict(group.named_parameters()) for group in groups]
        buffers = [dict(group.named_buffers()) for group in groups]
        stacked = {name: torch.stack([p[name] for p in parameters]) for name in parameters[0]}
        stacked_buffers = {name: torch.stack([b[name] for b in buffers]) for name in buffers[0]}
        if torch.is_grad_enabled():  # a frozen weight (the base under model/adapter) has no gradient to keep
            trained = {name: tensor for name, tensor in stacked.items() if tensor.requires_grad}
            for tensor in trained.values():
                tensor.retain_grad()
            self.stacks.append({(id(decoder), name): tensor for name, tensor in trained.items()})
            for index, group in enumerate(parameters):
                self.slots.update(
                    (param, (id(decoder), name, index)) for name, param in group.items() if name in trained
                )
        one_group = self._group_step(decoder, tuple(tensor.requires_grad for tensor in stacked.values()))
        partition = default_partition if decoder.remat is None else min_cut_rematerialization_partition
        aux_loss = torch.zeros((), dtype=torch.float32, device=hidden_states.device)
        segments = () if inputs.segment_ids is None else (inputs.segment_ids.float(),)
        carry = (hidden_states, positions.float(), aux_loss, *segments)
        (hidden_states, _, aux_loss, *_), _ = scan(
            one_group, carry, (stacked, stacked_buffers), partition_fn=partition, is_fn_pure=True
        )
        for layer in decoder.layers[num_groups * period :]:
            out = decoder.run_layer(
                layer, TransformerLayerInput(hidden_states, positions, segment_ids=inputs.segment_ids)
            )
            hidden_states, aux_loss = out.hidden_states, add_aux_loss(aux_loss, out.aux_loss)
        return hidden_states, aux_loss

    def _group_step(self, decoder: Decoder, trains: tuple[bool, ...]) -> _GroupStep:
        """The function the scan traces for one of ``decoder``'s groups, the same object for the same
        decoder, mode and trained weights (``trains``: each stacked weight's ``requires_grad``).

        Scan keeps its traced forward and backward per function object and input shapes
        (``is_fn_pure``): without it every forward traced the group again with AOTAutograd (0.4 s
        a call for the debug model; a scanned debug run spent 10 of its 28 s so). The mode (dropout)
        and which weights train are not in scan's key, so they pick the function: a group traced
        under ``no_grad`` (evaluation) has no weight gradients to give a training step.
        """
        key = (id(decoder), decoder.training, trains)
        if key in self._group_steps:
            return self._group_steps[key]
        period = decoder.config.period()
        if id(decoder) not in self._templates:  # a copy: tracing swaps its weights for the stacked slices
            self._templates[id(decoder)] = _ScanStep(copy.deepcopy(decoder.layers[:period]))
        template = self._templates[id(decoder)]
        training = decoder.training

        def one_group(carry: tuple[torch.Tensor, ...], weights: _GroupWeights) -> tuple[tuple[torch.Tensor, ...], None]:
            template.train(training)  # read while tracing, and scan traces only on a miss
            return torch.func.functional_call(template, weights, carry, strict=True), None

        self._group_steps[key] = one_group
        return one_group

    def clip_grad_norm(self, parameters: list[nn.Parameter], max_norm: Optional[float]) -> torch.Tensor:
        """The global L2 norm from the stacked gradients; every gradient scaled to at most ``max_norm``.

        The scanned layers' own gradients are dropped: they live on, scaled and stacked, until
        ``step_optimizer`` hands each layer its slice.
        """
        stacks, self.stacks = self.stacks, []
        keys = stacks[0] if stacks else {}
        stacked = {key: functools.reduce(operator.add, (_grad(stack[key]) for stack in stacks)) for key in keys}
        grads = [p.grad for p in parameters if p.grad is not None and p not in self.slots]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in [*grads, *stacked.values()]]))
        limit = max_norm if max_norm is not None else math.inf
        scale = torch.clamp(limit / (norm + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale)
        self._stacked_grads = {key: grad * scale for key, grad in stacked.items()}
        for param in parameters:
            if param in self.slots:
                param.grad = None
        return norm

    def step_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """One update program for the parameters outside the scanned groups, then one per group.

        An update of every parameter in one program grows with depth (it dominated a deep model's
        compile). Every group's update is the same program (same shapes, shardings, and its
        gradients sliced at a device-held index), compiled once and run once per group.
        """
        groups = optimizer.param_groups
        whole = [(group["params"], group["names"]) for group in groups]
        try:
            for part in sorted({self._part(p) for params, _ in whole for p in params}):
                for group, (params, names) in zip(groups, whole):
                    kept = [(p, n) for p, n in zip(params, names) if self._part(p) == part]
                    group["params"], group["names"] = [p for p, _ in kept], [n for _, n in kept]
                    for param in group["params"]:
                        if param in self.slots:
                            param.grad = self._layer_gradient(self.slots[param])
                optimizer.step()
                self.cut()
        finally:
            for group, (params, names) in zip(groups, whole):
                group["params"], group["names"] = params, names
            self._stacked_grads = {}

    def _part(self, param: nn.Parameter) -> tuple[int, int]:
        """The update a parameter belongs to: its decoder and group, or (-1, -1) outside the scans."""
        if param not in self.slots:
            return -1, -1
        decoder, _, index = self.slots[param]
        return decoder, index

    def _layer_gradient(self, slot: Slot) -> torch.Tensor:
        decoder, name, index = slot
        if index not in self._indices:
            self._indices[index] = torch.tensor([index], device=torch_xla.device())
        return torch.index_select(self._stacked_grads[decoder, name], 0, self._indices[index]).squeeze(0)


def _grad(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.grad is None:
        raise RuntimeError("a scanned training forward had no backward before the gradient norm")
    return tensor.grad
