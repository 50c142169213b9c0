"""Weight formats for decoding on a CPU: stacked projections, oneDNN's packed layout, and int8.

Decoding one token reads every weight once, so on a CPU it runs at the speed at which the matmul
kernel streams weights from memory. The candidates (``DecodeKernel``): torch's own ``linear``
(MKL's matrix-vector product) on the weights as stored; torch's matmul on copies stored
``[in, out]`` (``TransposedLinear``); oneDNN's kernel on copies reordered into its blocked layout
(``PackedLinear``); and axtorch's own product, compiled on this machine where it has a C compiler
(``native_kernels``), on the weights as stored (``NativeLinear``), or as their block codes where
they were expanded from a 4- or 8-bit GGUF format (``weight_codes``: the same weights in a third
to a fifth of the bytes), with its layer step (``native_layers``: the layers of a step of one to
eight rows in one call). The kernels round differently,
so the choice is a rule (``default_kernel``) or the caller's, never a timing: the same prompt gives
the same tokens on every run. ``benchmarks/decode.py`` times them all on a machine.

``decode_weights`` prepares a model for the duration of a ``with`` block, what ``generate`` does
by default: the queries', keys' and values' weights stacked into one matrix, and the gate's and
up projection's into another, filled into the layers' declared seams (``QKVProjection``,
``GateUpProjection``: one longer read and one call instead of three or two); for the two copy
kernels, the stacks, every other linear and the head copied into that kernel's layout (axtorch's
own reads them where they are). The same
float32 math up to summation order; the model's own modules and seams are put back afterwards.
Each prepared copy is kept while its weights live and reused while they are unchanged: preparing
reads and writes every weight once, which a short ``generate`` call would otherwise pay again.

``quantize_int8`` stores each chosen weight matrix as int8 with one scale per output channel (the
rule of ``axtorch.layers.int8_linear``, which a frozen int8 training base shares), and
quantizes activations per call (fbgemm's dynamic quantization): a quarter of the bytes, at a cost
in accuracy. ``pack_linears`` packs every float32 linear for oneDNN in place. Mixture-of-experts
weights, stored stacked rather than as linear layers, keep their format, and so does a linear
that holds an adapter (LoRA), whose output the rewritten module would lose. Both rewrites are for
inference only: the rewritten model has no gradients and no state dict of its linear weights.
"""

from __future__ import annotations

import contextlib
import enum
import fnmatch
import functools
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Optional, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from axtorch.infer.native_kernels import NativeLinear, load_matvec, reads_codes
from axtorch.infer.native_layers import fill_native_runners
from axtorch.infer.weight_codes import WeightCodes, codes_of, stacked
from axtorch.layers.attention import QKVProjection
from axtorch.layers.feed_forward import GateUpProjection
from axtorch.layers.int8_linear import quantize_per_channel_int8
from axtorch.layers.linear import Linear
from axtorch.layers.seams import modules_with_seam
from axtorch.models.causal_lm import CausalLM


class DecodeKernel(enum.Enum):
    """How ``decode_weights`` multiplies by a weight (``axtorch-generate decode.kernel=<name>``)."""

    #: torch's ``linear`` on the weights as stored, ``[out, in]`` (the stacks, copies anyway, ``[in, out]``).
    linear = "torch linear"
    #: torch's matmul, ``x @ W``, on copies stored ``[in, out]``: a layout some BLAS stream faster.
    transposed = "torch, [in, out]"
    #: oneDNN's kernel on copies in its blocked layout (``PackedLinear``).
    packed = "oneDNN packed"
    #: axtorch's own, compiled on this machine (``native_kernels``), on the weights as stored
    #: (``NativeLinear``), read as their block codes where they have them (``weight_codes``).
    native = "axtorch's own (C)"
    #: axtorch's own on the float32 weights only, never their codes: the same weights, several
    #: times the bytes where codes exist (to compare with, or where memory for the codes is short).
    native_float32 = "axtorch's own (C), float32"


class TransposedLinear(nn.Module):
    """``x @ W.T + b`` in float32, with ``W.T`` stored as a contiguous copy (``[in, out]``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.transposed = weight.detach().float().t().contiguous()
        self.bias = None if bias is None else bias.detach().float()
        self.in_features = weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.transposed
        return out if self.bias is None else out + self.bias


class PackedLinear(nn.Module):
    """``x @ W.T + b`` in float32, with ``W`` reordered once into oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        # Plain attributes, not buffers: an opaque oneDNN tensor has no storage to save or move.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), None)
        self.bias = None if bias is None else bias.detach().float()
        self.in_features = weight.shape[1]  # as ``Linear``'s: the width of the input it takes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int8Linear(nn.Module):
    """``x @ W.T + b`` with ``W`` in int8 per output channel and ``x`` quantized per call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        out_features, in_features = weight.shape
        values, scales = quantize_per_channel_int8(weight)  # the rule a frozen int8 training base uses too
        with warnings.catch_warnings():
            # torch 2.10+ announces that quantized tensors will go; until then they carry fbgemm's
            # int8 kernels (docs/inference.md says what replaces them when they do).
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
            quantized = torch._make_per_channel_quantized_tensor(
                values, scales.double(), torch.zeros(out_features, dtype=torch.long), 0
            )
            self.inner = torch.ao.nn.quantized.dynamic.Linear(in_features, out_features, bias_=bias is not None)
        self.inner.set_weight_bias(quantized, None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)


#: Left in float32 by default: the feed-forward layers. Their activations carry outliers that
#: int8 activations lose (SmolLM2-135M's perplexity rose 24% with them quantized, 7.5% without;
#: ``benchmarks/decode.py``).
DEFAULT_SKIP = ("*.feed_forward.*",)


def _on_the_cpu(model: CausalLM, what: str) -> None:
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"{what} runs on the CPU; move the model to the CPU first")


#: What ``_replace_linears`` replaced: (parent module, attribute name, the module it held, or None).
Replaced = list[tuple[nn.Module, str, Optional[nn.Module]]]


def _plain(module: nn.Module) -> bool:
    """A float32 ``Linear`` without an adapter: its output is its weight's product, nothing more."""
    return type(module) is Linear and module.adapter is None and module.weight.dtype == torch.float32


def _replace_linears(
    model: CausalLM,
    make: Callable[[torch.Tensor, Optional[torch.Tensor]], nn.Module],
    skip: Sequence[str] = (),
    keep: AbstractSet[str] = frozenset(),
) -> Replaced:
    """Replace, in place, every plain ``Linear`` whose module name is not in ``keep`` and matches no
    pattern of ``skip`` (fnmatch), and the output head (tied: a copy of the embedding table), by
    ``make(weight, bias)``."""
    replaced: Replaced = []
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            full_name = f"{path}.{name}" if path else name
            if _plain(child) and full_name not in keep and not any(fnmatch.fnmatch(full_name, p) for p in skip):
                replaced.append((module, name, child))
                setattr(module, name, make(child.weight, child.bias))
    if model.lm_head is None:
        replaced.append((model, "lm_head", None))
        model.lm_head = make(model.embedding.weight, None)  # type: ignore[assignment]
    return replaced


#: ``decode_weights``'s copies: a weight -> (its kind, the addresses and versions of the tensors
#: it was made from, the copy). Weak keys: a copy goes when its weight does.
_PREPARED = WeakIdKeyDictionary()
Prepared = TypeVar("Prepared")


def _reused(kind: str, tensors: Sequence[Optional[torch.Tensor]], make: Callable[[], Prepared]) -> Prepared:
    """``make()``, reused from an earlier call for the same ``kind`` while ``tensors`` are the same
    tensors, unmodified: an optimizer step or a load bumps their versions, a new tensor has another
    address, and either makes it afresh. The copy is filed under ``tensors[0]``."""
    stamp = (kind, *(v for t in tensors if t is not None for v in (t.data_ptr(), t._version)))
    anchor = tensors[0]
    assert anchor is not None
    cached = _PREPARED.get(anchor)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    prepared = make()
    _PREPARED[anchor] = (stamp, prepared)
    return prepared


def native_codes(weights: Sequence[torch.Tensor]) -> Optional[WeightCodes]:
    """The block codes axtorch's own kernel reads for ``weights`` stacked (one weight: its own),
    where this machine's kernels read codes and every weight has them (``weight_codes``)."""
    return stacked([codes_of(weight) for weight in weights]) if reads_codes() else None


def _native_linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> NativeLinear:
    """axtorch's own product of ``weight``, reading its block codes where it has them."""
    return NativeLinear(weight, bias, native_codes([weight]))


#: The module each kernel but torch's ``linear`` multiplies through.
_KERNEL_MODULES: dict[DecodeKernel, Callable[[torch.Tensor, Optional[torch.Tensor]], nn.Module]] = {
    DecodeKernel.transposed: TransposedLinear,
    DecodeKernel.packed: PackedLinear,
    DecodeKernel.native: _native_linear,
    DecodeKernel.native_float32: NativeLinear,
}
#: The kernels that are axtorch's own, with its layer step.
NATIVE = (DecodeKernel.native, DecodeKernel.native_float32)


def _module_maker(kernel: DecodeKernel) -> Callable[[torch.Tensor, Optional[torch.Tensor]], nn.Module]:
    """The kernel's module for a weight and bias; a kernel's copies (axtorch's own: the weight's
    block codes) are made once and reused (``_reused``)."""
    make = _KERNEL_MODULES[kernel]
    return lambda weight, bias: _reused(kernel.name, (weight, bias), lambda: make(weight, bias))


def available_kernels() -> list[DecodeKernel]:
    """The kernels this machine has: oneDNN's where torch was built with it, axtorch's where it compiled."""
    unavailable = {
        DecodeKernel.packed: not torch.backends.mkldnn.is_available(),
        DecodeKernel.native: load_matvec() is None,
        DecodeKernel.native_float32: load_matvec() is None,
    }
    return [kernel for kernel in DecodeKernel if not unavailable.get(kernel, False)]


class StackedProjection:
    """A ``QKVProjection`` or ``GateUpProjection`` for decoding: one product by several linears'
    weights stacked, split back into each linear's output (views of one tensor).

    For torch's kernel the stack is stored transposed, ``[in, out]``, and multiplied as ``x @ W``:
    MKL streams a row-major ``[in, out]`` operand of a batch-1 product about 10% faster than the
    ``[out, in]`` weight ``linear`` reads through a transposed view (``docs/benchmarks.md``), and
    the stack is a copy either way."""

    def __init__(self, linears: Sequence[Linear], kernel: DecodeKernel):
        weight = torch.cat([linear.weight.detach() for linear in linears])
        bias = None
        if any(linear.bias is not None for linear in linears):
            bias = torch.cat([weight.new_zeros(m.out_features) if m.bias is None else m.bias.detach() for m in linears])
        self.sizes = [linear.out_features for linear in linears]
        self.product: Callable[[torch.Tensor], torch.Tensor]
        if kernel is DecodeKernel.packed:
            self.product = PackedLinear(weight, bias)
        elif kernel in NATIVE:
            codes = native_codes([linear.weight for linear in linears]) if kernel is DecodeKernel.native else None
            self.product = NativeLinear(weight, bias, codes)
        else:
            transposed = weight.t().contiguous()
            self.product = (lambda x: x @ transposed) if bias is None else (lambda x: x @ transposed + bias)

    def __call__(self, owner: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.product(x).split(self.sizes, dim=-1)


#: The seams ``decode_weights`` fills, and the owner's linears (by attribute) that each stacks.
STACKED_SEAMS: dict[type, tuple[str, ...]] = {
    QKVProjection: ("q_proj", "k_proj", "v_proj"),
    GateUpProjection: ("gate_proj", "up_proj"),
}


def time_kernels(weights: Sequence[torch.Tensor], trials: int = 3) -> dict[DecodeKernel, float]:
    """Seconds each available kernel takes for one batch-1 product by every weight of ``weights``,
    the best of ``trials`` passes. The kernels take turns, each with its copies made just before
    its passes and dropped after them, so the weights are held at most twice (Gemma 3 270M's 1.07 GB:
    copies and passes about 3 s on one thread)."""
    inputs = [weight.new_ones(1, weight.shape[1]) for weight in weights]
    best = dict.fromkeys(available_kernels(), math.inf)
    for kernel in best:
        make = _KERNEL_MODULES.get(kernel)
        products: list[Callable[[torch.Tensor], torch.Tensor]] = (
            [functools.partial(F.linear, weight=w) for w in weights]
            if make is None
            else [make(w, None) for w in weights]
        )
        for _ in range(trials):
            started = time.perf_counter()
            for x, product in zip(inputs, products):
                product(x)
            best[kernel] = min(best[kernel], time.perf_counter() - started)
        del products
    return best


def default_kernel() -> DecodeKernel:
    """axtorch's own kernel where it compiled here, else torch's ``linear``: a rule, so that a
    prompt decodes to the same tokens on every run on a machine.

    axtorch's own led every kernel ``benchmarks/decode.py`` timed on this project's hosts, on one
    and on two threads (SmolLM2-135M and Gemma 3 270M: 73-93% of the read bandwidth on one thread,
    where the best of the others read 34-60%; ``docs/benchmarks.md``), helped by its layer step
    (``native_layers``), which saves more than its products' lead. Another machine's BLAS may
    stream faster: ``axtorch-generate decode.kernel=<name>`` (or ``decode_weights(model, kernel)``)
    picks one, and the benchmark says which.
    """
    return DecodeKernel.native if DecodeKernel.native in available_kernels() else DecodeKernel.linear


def kernel_refusal(kernel: Optional[DecodeKernel], compile: bool = False) -> Optional[str]:
    """Why ``kernel`` (None: the rule's) cannot decode here, or None: one this machine lacks, or
    another than torch's linear under ``compile`` (inductor lowers torch's linear)."""
    if kernel is None:
        return None
    if compile and kernel is not DecodeKernel.linear:
        return f"a compiled decode step multiplies with torch's linear, not {kernel.name}"
    available = [k.name for k in available_kernels()]
    if kernel.name not in available:
        return f"decode kernel {kernel.name!r} is not available on this machine; available: {available}"
    return None


def product_weights(model: CausalLM) -> list[torch.Tensor]:
    """The weights a decode step multiplies by in a copy kernel's layout: every plain linear's, and the tied head's."""
    weights = [cast(torch.Tensor, m.weight) for m in model.modules() if _plain(m)]
    if model.lm_head is None:
        weights.append(model.embedding.weight)
    return weights


def can_pack(model: CausalLM) -> bool:
    """Whether ``decode_weights`` applies: float32 weights on a CPU."""
    parameter = next(model.parameters())
    return parameter.device.type == "cpu" and parameter.dtype == torch.float32


@contextlib.contextmanager
def decode_weights(model: CausalLM, kernel: Optional[DecodeKernel] = None) -> Iterator[CausalLM]:
    """The model with its decode weight formats (see the module's docstring) for a ``with`` block;
    its own modules and seams are put back afterwards, so the caller's model still trains and
    saves. The prepared copies stay for the next block (``_reused``). ``kernel``: the one to
    decode with (``DecodeKernel.linear``: what ``torch.compile`` lowers as it was measured); None,
    the rule's (``default_kernel``)."""
    _on_the_cpu(model, "CPU decode weights")
    if refusal := kernel_refusal(kernel):
        raise ValueError(refusal)
    kernel = kernel or default_kernel()
    seams: list[tuple[nn.Module, str, object]] = []
    stacked: set[str] = set()
    native_stacks: dict[nn.Module, NativeLinear] = {}
    with torch.no_grad():
        for protocol, names in STACKED_SEAMS.items():
            for path, owner, slot in list(modules_with_seam(model, protocol)):
                linears = [getattr(owner, name) for name in names]
                if not all(_plain(linear) for linear in linears):
                    continue
                tensors = [t for linear in linears for t in (linear.weight, linear.bias)]
                kind = f"{kernel.name} stack"
                projection = _reused(kind, tensors, functools.partial(StackedProjection, linears, kernel))
                seams.append((owner, slot, getattr(owner, slot)))
                setattr(owner, slot, projection)
                stacked.update(f"{path}.{name}" for name in names)
                if isinstance(projection.product, NativeLinear):
                    native_stacks[owner] = projection.product
        replaced = [] if kernel is DecodeKernel.linear else _replace_linears(model, _module_maker(kernel), keep=stacked)
        if kernel in NATIVE:
            seams += fill_native_runners(model, native_stacks)
    try:
        yield model
    finally:
        for parent, name, original in reversed(replaced):
            if original is None:
                delattr(parent, name)  # a tied head: back to the plain attribute ``None`` it was
            setattr(parent, name, original)
        for owner, slot, default in seams:
            setattr(owner, slot, default)


@torch.no_grad()
def pack_linears(model: CausalLM) -> CausalLM:
    """Every float32 ``Linear`` and the output head as a ``PackedLinear``; what is already int8 stays."""
    _on_the_cpu(model, "oneDNN packing")
    _replace_linears(model, PackedLinear)
    return model.eval()


@torch.no_grad()
def quantize_int8(model: CausalLM, skip: Sequence[str] = DEFAULT_SKIP) -> CausalLM:
    """Every ``Linear`` and the output head as an ``Int8Linear``, except the linears whose module
    names match a pattern of ``skip`` (fnmatch)."""
    _on_the_cpu(model, "int8 decoding (fbgemm kernels)")
    _replace_linears(model, Int8Linear, skip)
    return model.eval()
