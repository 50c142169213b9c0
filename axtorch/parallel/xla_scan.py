"""Scanned decoder layers on the xla backend (``execution.layer_runner=scan``): compile time flat in depth.

A scan compiles one layer and loops it over the layers' weights stacked on a leading dimension.
What else in a training step touches every layer's parameters separately would still grow the
programs with depth, so this module keeps those out of them too:

* the gradients stay stacked: the gradient norm reads the stacked weights' gradients (a few
  reductions, not one per layer), and the step's program writes no per-layer gradient out;
* the optimizer updates one layer at a time, the same program for every layer, compiled once:
  it takes the layer's gradient from the stacked one at an index held on the device (a slice at
  a Python index would be baked into each layer's program, making them all different).

Imported only by the xla backend: it needs torch_xla.
"""

from __future__ import annotations

import copy
import functools
import math
import operator
from typing import Optional

import torch
import torch_xla
from functorch.compile import default_partition, min_cut_rematerialization_partition
from torch import nn
from torch_xla.experimental.scan import scan

from axtorch.layers.transformer import Decoder, DecoderInput, TransformerLayerInput, add_aux_loss, run_layers_unrolled

#: A stacked weight: (its decoder's id, the parameter's name within a layer).
StackKey = tuple[int, str]
#: Where a scanned layer's parameter sits: (decoder, stacked name, layer index).
Slot = tuple[int, str, int]


class _ScanStep(nn.Module):
    """One decoder layer as a function of the scan carry ``(hidden_states, positions, aux_loss)``.

    Positions travel as float32 (exact below 2**24), since scan's carry must be differentiable.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(
        self, hidden_states: torch.Tensor, positions: torch.Tensor, aux_loss: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.layer(TransformerLayerInput(hidden_states, positions.long()))
        return out.hidden_states, positions.clone(), add_aux_loss(aux_loss, out.aux_loss)


class LayerScan:
    """The ``LayerRunner`` the xla backend fills decoders' seam with, its gradient norm and update.

    It stacks every layer of a decoder, which all share one config. (A decoder whose layers follow
    a pattern of configs would scan each repeated group of the pattern as one step instead.)

    Each training forward's stacked weights keep their gradients (``retain_grad``): summed over
    the step's micro-batches, they are the layers' gradients, stacked.
    """

    def __init__(self) -> None:
        self.stacks: list[dict[StackKey, torch.Tensor]] = []  # this step's training forwards
        self.slots: dict[nn.Parameter, Slot] = {}  # the scanned layers' parameters
        self._templates: dict[int, _ScanStep] = {}  # per decoder: the layer the scan traces
        self._stacked_grads: dict[StackKey, torch.Tensor] = {}  # clipped, until the update
        self._indices: dict[int, torch.Tensor] = {}  # layer index -> the same on the device

    def __call__(self, decoder: Decoder, inputs: DecoderInput) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run ``decoder``'s layers as one compiled loop over their stacked weights.

        The decoder's remat policy becomes AOTAutograd's min-cut rematerialisation of the scanned
        layer (``torch.utils.checkpoint`` does not apply inside a traced scan body). A decode step
        with KV caches runs unrolled: the scan's carry holds no per-layer caches.
        """
        if inputs.segment_ids is not None:
            raise ValueError(
                "execution.layer_runner=scan carries no segment ids: document masking (packed documents) "
                "runs with the unrolled layer runner"
            )
        if inputs.kv_caches is not None:
            return run_layers_unrolled(decoder, inputs)
        hidden_states, positions = inputs.hidden_states, inputs.positions
        layers = [_ScanStep(layer) for layer in decoder.layers]
        parameters = [dict(layer.named_parameters()) for layer in layers]
        buffers = [dict(layer.named_buffers()) for layer in layers]
        stacked = {name: torch.stack([p[name] for p in parameters]) for name in parameters[0]}
        stacked_buffers = {name: torch.stack([b[name] for b in buffers]) for name in buffers[0]}
        if torch.is_grad_enabled():
            for tensor in stacked.values():
                tensor.retain_grad()
            self.stacks.append({(id(decoder), name): tensor for name, tensor in stacked.items()})
            for index, layer in enumerate(parameters):
                self.slots.update((param, (id(decoder), name, index)) for name, param in layer.items())
        if id(decoder) not in self._templates:  # a copy: tracing swaps its weights for the stacked slices
            self._templates[id(decoder)] = _ScanStep(copy.deepcopy(decoder.layers[0]))
        template = self._templates[id(decoder)]

        def one_layer(carry, weights):
            return torch.func.functional_call(template, weights, carry, strict=True), None

        partition = default_partition if decoder.remat is None else min_cut_rematerialization_partition
        aux_loss = torch.zeros((), dtype=torch.float32, device=hidden_states.device)
        carry = (hidden_states, positions.float(), aux_loss)
        (hidden_states, _, aux_loss), _ = scan(one_layer, carry, (stacked, stacked_buffers), partition_fn=partition)
        return hidden_states, aux_loss

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
        """One update program for the parameters outside the scanned layers, then one per layer.

        An update of every parameter in one program grows with depth (it dominated a deep model's
        compile). Every layer's update is the same program (same shapes, shardings, and its
        gradients sliced at a device-held index), compiled once and run once per layer.
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
                torch_xla.sync()
        finally:
            for group, (params, names) in zip(groups, whole):
                group["params"], group["names"] = params, names
            self._stacked_grads = {}

    def _part(self, param: nn.Parameter) -> tuple[int, int]:
        """The update a parameter belongs to: its decoder and layer, or (-1, -1) outside the scans."""
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
