"""A decoder's layers as calls of axtorch's compiled layer step (``decode_layer.c``) when decoding
one token of each of 1 to 8 rows on a CPU.

In a batch-1 decode step of a small model the layers' small ops and module calls (norms,
rotations, cache writes, attention, reshapes, a dozen modules a layer) took about as long as
streaming their weights: SmolLM2-135M, 16 ms besides 17 ms of products a token on one thread
(docs/benchmarks.md). ``NativeLayerRunner`` fills a decoder's ``LayerRunner`` seam while
``decode_weights`` holds axtorch's own kernel: a layer whose composition ``native_layer``
recognises runs in C on the weights the decode formats hold (the q/k/v and gate/up stacks, the
linears' own weights), consecutive ones in one call; any other layer runs its modules, and so does
every forward that is not one token of each of 1 to 8 rows (a prefill, a larger batch), through
the default ``run_layers_unrolled``.
What depends only on the position, the rotary tables and the mask, still comes from each layer's
own children (``RotaryEmbedding.tables``, the attention's mask), so their rules live in one place.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, cast

import torch
from torch import nn

from axtorch.infer.native_kernels import (
    MAX_ROWS,
    NO_KERNELS,
    MatrixStruct,
    NativeLinear,
    load_library,
    matrix_struct,
    tracing,
)
from axtorch.layers.attention import GroupedQueryAttention
from axtorch.layers.attention_kernel import SdpaKernel, SoftcappedKernel
from axtorch.layers.feed_forward import Activation, GatedFeedForward
from axtorch.layers.kv_cache import KVCache
from axtorch.layers.norm import RMSNorm
from axtorch.layers.relative_position import NoPosition, RotaryEmbedding
from axtorch.layers.residual import PreNormResidual, SandwichNormResidual
from axtorch.layers.seams import modules_with_seam
from axtorch.layers.shared_values import SharedValues
from axtorch.layers.transformer import (
    Decoder,
    DecoderInput,
    LayerRunner,
    TransformerLayer,
    TransformerLayerInput,
    add_aux_loss,
    run_layers_unrolled,
)

#: ``decode_layer.c``'s ``enum activation``.
ACTIVATIONS = {Activation.silu: 0, Activation.gelu: 1, Activation.gelu_tanh: 2, Activation.relu: 3}
NORMS = (
    "attention_norm",
    "attention_post_norm",
    "feed_forward_norm",
    "feed_forward_post_norm",
    "query_norm",
    "key_norm",
)
#: The products' weights, each float32 and, where ``weight_codes`` found them, block codes and scales.
MATRICES = ("qkv", "output", "gate_up", "down")
BIASES = tuple(f"{matrix}_bias" for matrix in MATRICES)
#: A layer's tensors as the step and its operator take them (None where the layer has no such part).
WEIGHTS = (*NORMS, *BIASES, *(f"{matrix}{part}" for matrix in MATRICES for part in ("", "_codes", "_scales")))


class LayerStruct(ctypes.Structure):
    """``decode_layer.c``'s ``layer_t``: a layer's sizes, constants and weight addresses."""

    _fields_ = [
        *((name, ctypes.c_long) for name in ("dim", "heads", "kv_heads", "head_dim", "hidden")),
        *((name, ctypes.c_float) for name in ("norm_eps", "head_norm_eps", "scale", "softcap")),
        ("activation", ctypes.c_int),
        *((name, ctypes.c_void_p) for name in NORMS + BIASES),
        *((name, MatrixStruct) for name in MATRICES),
    ]


def layer_struct(
    weights: Sequence[Optional[torch.Tensor]], sizes: Sequence[int], constants: Sequence[float]
) -> LayerStruct:
    """The step's ``layer_t``: ``sizes`` (dim, heads, kv_heads, head_dim, hidden, activation),
    ``constants`` (norm_eps, head_norm_eps, scale, softcap) and the ``weights`` in ``WEIGHTS``' order."""
    *shape, activation = sizes
    named = dict(zip(WEIGHTS, weights))
    parts = (named[name] for name in NORMS + BIASES)
    addresses = (None if part is None else part.data_ptr() for part in parts)
    matrices = []
    for matrix in MATRICES:
        weight = named[matrix]
        assert weight is not None  # every recognised layer has its four products
        matrices.append(matrix_struct(weight, named[f"{matrix}_codes"], named[f"{matrix}_scales"]))
    return LayerStruct(*shape, *constants, activation, *addresses, *matrices)


class LayerCall(ctypes.Structure):
    """``decode_layer.c``'s ``layer_call_t``: one layer of a step, its inputs' and its cache's addresses."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("layer", "cos", "sin", "allowed", "keys", "values")),
        ("slots", ctypes.c_long),
        ("slot", ctypes.c_void_p),
    ]


@dataclass
class StepInputs:
    """What one layer's step reads besides its weights: each row's allowed slots [B, slots] (bool),
    its position's tables (cos, sin [B, 1, 1, head_dim], None without rotation), and its cache
    slot [B] (int64)."""

    allowed: torch.Tensor
    cos: Optional[torch.Tensor]
    sin: Optional[torch.Tensor]
    slots: torch.Tensor

    def call(self, struct: LayerStruct, keys: torch.Tensor, values: torch.Tensor) -> LayerCall:
        """The call of ``struct``'s layer writing ``keys`` and ``values``; every tensor must outlive it."""
        tables = (None, None) if self.cos is None or self.sin is None else (self.cos.data_ptr(), self.sin.data_ptr())
        # keys.shape[2]: the cache's slots (``KVCache.max_len``), fewer than the positions for a ring.
        addresses = (self.allowed.data_ptr(), keys.data_ptr(), values.data_ptr())
        return LayerCall(ctypes.addressof(struct), *tables, *addresses, keys.shape[2], self.slots.data_ptr())


@functools.cache
def layers_step(library: ctypes.CDLL) -> Callable[[Sequence[LayerCall], torch.Tensor, torch.Tensor, int], None]:
    """``decode_layer.c``'s step of consecutive layers in ``library``, as a function of their
    calls, ``x`` [B, 1, dim] (updated in place), the scratch and the thread count."""
    step = library.axtorch_decode_layers
    pointer, long = ctypes.c_void_p, ctypes.c_long
    step.argtypes = [ctypes.POINTER(LayerCall), long, long, pointer, pointer, ctypes.c_int]
    step.restype = None

    def run(calls: Sequence[LayerCall], x: torch.Tensor, scratch: torch.Tensor, threads: int) -> None:
        array = (LayerCall * len(calls))(*calls)
        step(array, len(calls), x.shape[0], x.data_ptr(), scratch.data_ptr(), threads)

    return run


@torch.library.custom_op("axtorch::decode_layer", mutates_args=("x", "keys", "values", "scratch"))
def decode_layer_operator(
    x: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scratch: torch.Tensor,
    allowed: torch.Tensor,
    cos: Optional[torch.Tensor],
    sin: Optional[torch.Tensor],
    weights: list[Optional[torch.Tensor]],
    sizes: list[int],
    constants: list[float],
    slots: torch.Tensor,
    threads: int,
) -> None:
    """One layer's step as a torch operator: ``x`` [B, 1, dim] updated in place, each row's token's
    keys and values written at its slot (``slots`` [B], int64) of ``keys`` and ``values`` [B,
    kv_heads, cache slots, head_dim]."""
    library = load_library()
    if library is None:
        raise RuntimeError(NO_KERNELS)
    struct = layer_struct(weights, sizes, constants)
    call = StepInputs(allowed, cos, sin, slots).call(struct, keys, values)
    layers_step(library)([call], x, scratch, threads)


@decode_layer_operator.register_fake
def _(*arguments: object) -> None:
    return None


@dataclass
class NativeLayer:
    """One layer as the compiled step reads it, and the children that compute its tables."""

    #: In ``WEIGHTS``' order, None where the layer has no such part.
    weights: list[Optional[torch.Tensor]]
    sizes: list[int]
    constants: list[float]
    attention: GroupedQueryAttention
    rotary: Optional[RotaryEmbedding]

    def __post_init__(self) -> None:
        #: What eager steps pass, built once: it points into ``weights``, held as long as it is.
        self.struct = layer_struct(self.weights, self.sizes, self.constants)


class _Unsupported(Exception):
    """A part of a layer that the compiled step does not compute."""


def _rms_norm(module: Optional[nn.Module]) -> Optional[RMSNorm]:
    """``module`` if it is a float32 RMS norm (or None if it is None); raises ``_Unsupported`` otherwise."""
    if module is None:
        return None
    if type(module) is not RMSNorm or module.weight.dtype != torch.float32:
        raise _Unsupported
    return module


def native_layer(layer: nn.Module, stacks: Mapping[nn.Module, NativeLinear]) -> Optional[NativeLayer]:
    """``layer`` for the compiled step, or None where its composition holds a part the step does
    not compute. ``stacks``: the q/k/v and gate/up stacks ``decode_weights`` made, by their owner
    (the attention, the feed-forward). Recognised: pre- or sandwich-norm placement, RMS norms,
    optional per-head query and key norms, rotary or no position encoding, torch's or the
    soft-capped attention kernel, any mask (computed by the layer's own), a gated feed-forward."""
    if type(layer) is not TransformerLayer:
        return None
    attention, feed_forward = layer.attention, layer.feed_forward
    if type(attention) is not GroupedQueryAttention or type(feed_forward) is not GatedFeedForward:
        return None
    qkv, gate_up = stacks.get(attention), stacks.get(feed_forward)
    output, down = attention.o_proj, feed_forward.down_proj
    if qkv is None or gate_up is None or type(output) is not NativeLinear or type(down) is not NativeLinear:
        return None
    placement = type(layer.attention_residual)
    if placement not in (PreNormResidual, SandwichNormResidual) or type(layer.feed_forward_residual) is not placement:
        return None
    if type(attention.position) not in (RotaryEmbedding, NoPosition):
        return None
    if type(attention.kernel) not in (SdpaKernel, SoftcappedKernel):
        return None
    try:
        norms = [_rms_norm(layer.attention_norm), _rms_norm(layer.feed_forward_norm)]
        post_norms = [None, None]
        if placement is SandwichNormResidual:
            post_norms = [
                _rms_norm(layer.attention_residual.post_norm),
                _rms_norm(layer.feed_forward_residual.post_norm),
            ]
        head_norms = [_rms_norm(attention.query_norm), _rms_norm(attention.key_norm)]
    except _Unsupported:
        return None
    if len({norm.eps for norm in norms + post_norms if norm is not None}) != 1:
        return None
    if len({norm.eps for norm in head_norms if norm is not None}) > 1:
        return None
    weights = {
        "attention_norm": norms[0],
        "feed_forward_norm": norms[1],
        "attention_post_norm": post_norms[0],
        "feed_forward_post_norm": post_norms[1],
        "query_norm": head_norms[0],
        "key_norm": head_norms[1],
    }
    tensors = {name: None if norm is None else norm.weight.detach().contiguous() for name, norm in weights.items()}
    for name, product in (("qkv", qkv), ("output", output), ("gate_up", gate_up), ("down", down)):
        tensors[name], tensors[f"{name}_bias"] = product.weight, product.bias
        tensors[f"{name}_codes"], tensors[f"{name}_scales"] = product.code_tensors
    head_dim = attention.head_dim
    sizes = [
        output.weight.shape[0],
        output.in_features // head_dim,
        (qkv.weight.shape[0] - output.in_features) // (2 * head_dim),
        head_dim,
        down.in_features,
        ACTIVATIONS[feed_forward.activation],
    ]
    constants = [
        norms[0].eps,
        next((norm.eps for norm in head_norms if norm is not None), 0.0),
        head_dim**-0.5 if attention.config.softmax_scale is None else attention.config.softmax_scale,
        attention.kernel.cap if type(attention.kernel) is SoftcappedKernel else 0.0,
    ]
    rotary = attention.position if type(attention.position) is RotaryEmbedding else None
    return NativeLayer([tensors[name] for name in WEIGHTS], sizes, constants, attention, rotary)


class NativeLayerRunner:
    """A decoder's ``LayerRunner`` for decoding on a CPU: the layers ``native_layer`` recognised
    (``layers``, None for the others) as compiled steps, one token of each of 1 to ``MAX_ROWS``
    rows at a time, in evaluation without gradients; any other forward runs ``run_layers_unrolled``.

    Eagerly, each run of consecutive recognised layers is one C call: their inputs (masks, tables,
    slots) are computed first, then the layers run in one parallel region."""

    def __init__(self, library: ctypes.CDLL, layers: Sequence[Optional[NativeLayer]]):
        self.layers = list(layers)
        self.run_steps = layers_step(library)
        self.scratch_floats = library.axtorch_decode_layer_scratch
        self.scratch_floats.argtypes = [ctypes.POINTER(LayerStruct), ctypes.c_long, ctypes.c_long]
        self.scratch_floats.restype = ctypes.c_long
        self.scratch = torch.empty(0)
        self.scratch_for: tuple[int, ...] = ()

    def _scratch(self, caches: Sequence[KVCache], rows: int) -> torch.Tensor:
        """Room for any layer's step at its cache's length, allocated once per set of cache lengths and rows."""
        lengths = tuple(cache.max_len for cache in caches)
        if (*lengths, rows) != self.scratch_for:
            floats = max(
                self.scratch_floats(ctypes.byref(native.struct), length, rows)
                for native, length in zip(self.layers, lengths)
                if native is not None
            )
            self.scratch, self.scratch_for = torch.empty(floats), (*lengths, rows)
        return self.scratch

    def __call__(self, decoder: Decoder, inputs: DecoderInput) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        x, caches = inputs.hidden_states, inputs.kv_caches
        rows = x.shape[0]
        if (
            caches is None
            or x.shape[1] != 1
            or not 1 <= rows <= MAX_ROWS
            or x.dtype != torch.float32
            or inputs.segment_ids is not None
            or torch.is_grad_enabled()
            or decoder.training  # dropout, which the step does not apply
            or any(c.keys.dtype != torch.float32 or c.keys.shape[0] != rows for c in caches)
        ):
            return run_layers_unrolled(decoder, inputs)
        x = x.clone(memory_format=torch.contiguous_format)  # the steps write it in place
        row_positions = inputs.positions.reshape(-1, 1).expand(rows, 1)  # [B, 1], also where all rows share one
        positions = row_positions.reshape(rows).tolist()
        scratch, shared, threads = self._scratch(caches, rows), SharedValues(), torch.get_num_threads()
        written: set[int] = set()  # ring caches share their slot positions (``allocate_kv_caches``)
        slots_by_layout: dict[tuple[Optional[int], int], torch.Tensor] = {}  # full caches, and rings of one size
        eager = not tracing(x)
        pending: list[LayerCall] = []  # the run of recognised layers not yet called
        held: list[StepInputs] = []  # what their calls point into
        aux_loss = None
        for layer, native, cache in zip(decoder.layers, self.layers, caches):
            if native is None:
                self._run(pending, x, scratch, threads, caches)
                out = decoder.run_layer(layer, TransformerLayerInput(x, inputs.positions, cache, None, shared))
                x, aux_loss = out.hidden_states.contiguous(), add_aux_loss(aux_loss, out.aux_loss)
                continue
            layout = (cache.window, cache.max_len)
            if layout not in slots_by_layout:
                slots_by_layout[layout] = torch.tensor([cache.slot(p) for p in positions], dtype=torch.long)
            slots = slots_by_layout[layout]
            if cache.window is not None and id(cache.slot_positions) not in written:
                cache.slot_positions[torch.arange(rows), slots] = torch.tensor(positions)
                written.add(id(cache.slot_positions))
            allowed = native.attention.mask(row_positions, cache.slot_positions, None, None, shared).contiguous()
            cos = sin = None
            if native.rotary is not None:
                cos, sin = (t.contiguous() for t in native.rotary.tables(row_positions, x.device, shared))
            step = StepInputs(allowed, cos, sin, slots)
            if eager:
                pending.append(step.call(native.struct, cache.keys, cache.values))
                held.append(step)
            else:
                torch.ops.axtorch.decode_layer(
                    x, cache.keys, cache.values, scratch, allowed, cos, sin,
                    native.weights, native.sizes, native.constants, slots, threads,
                )  # fmt: skip
        self._run(pending, x, scratch, threads, caches)
        return x, aux_loss

    def _run(
        self,
        pending: list[LayerCall],
        x: torch.Tensor,
        scratch: torch.Tensor,
        threads: int,
        caches: Sequence[KVCache],
    ) -> None:
        """Run the ``pending`` layers' steps in one call (none if empty), then empty it; bump the
        versions of what they wrote, as the operator would."""
        if not pending:
            return
        self.run_steps(pending, x, scratch, threads)
        pending.clear()
        torch.autograd.graph.increment_version((x, *(t for cache in caches for t in (cache.keys, cache.values))))


def fill_native_runners(
    model: nn.Module, stacks: Mapping[nn.Module, NativeLinear]
) -> list[tuple[nn.Module, str, object]]:
    """Put a ``NativeLayerRunner`` into every decoder's ``LayerRunner`` seam that holds the default
    and has a layer ``native_layer`` recognises; returns ``(decoder, slot, what it held)`` of each
    (none where the decode kernels did not build: ``load_library``)."""
    filled: list[tuple[nn.Module, str, object]] = []
    library = load_library()
    if library is None:
        return filled
    for _, decoder, slot in list(modules_with_seam(model, LayerRunner)):
        if getattr(decoder, slot) is not run_layers_unrolled:
            continue
        layers = [native_layer(layer, stacks) for layer in cast(Decoder, decoder).layers]
        if any(native is not None for native in layers):
            filled.append((decoder, slot, run_layers_unrolled))
            setattr(decoder, slot, NativeLayerRunner(library, layers))
    return filled
