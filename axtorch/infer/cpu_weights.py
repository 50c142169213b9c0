"""Weight formats for decoding on a CPU: float32 in oneDNN's packed layout, and int8.

Decoding one token reads every weight once, so on a CPU it runs at the speed at which the matmul
kernel streams weights from memory. PyTorch's default fp32 ``linear`` streams a batch-1 product
at about a quarter of this machine's read bandwidth; oneDNN, given its weights reordered once
into its blocked layout, streams about twice as fast (``pack_linears``: the same float32 math,
up to summation order). ``quantize_int8`` stores each chosen weight matrix as int8 with one scale
per output channel, and quantizes activations per call (fbgemm's dynamic quantization): a
quarter of the bytes, at a cost in accuracy. Mixture-of-experts weights, stored stacked rather
than as linear layers, keep their format. Both are for inference only: the rewritten model has no
gradients and no state dict of its linear weights. ``packed_linears`` packs for the duration of a
``with`` block and puts the model's own modules back afterwards: what ``generate`` does by default.
It keeps each packed copy while its module lives and reuses it while the weight is unchanged: packing
reads and writes every weight once, which a short ``generate`` call would otherwise pay again each time.
"""

from __future__ import annotations

import contextlib
import fnmatch
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from axtorch.layers.linear import Linear
from axtorch.models.causal_lm import CausalLM


class PackedLinear(nn.Module):
    """``x @ W.T + b`` in float32, with ``W`` reordered once into oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        # Plain attributes, not buffers: an opaque oneDNN tensor has no storage to save or move.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), None)
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int8Linear(nn.Module):
    """``x @ W.T + b`` with ``W`` in int8 per output channel and ``x`` quantized per call."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        out_features, in_features = weight.shape
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        with warnings.catch_warnings():
            # torch 2.10+ announces that quantized tensors will go; until then they carry fbgemm's
            # int8 kernels (docs/inference.md says what replaces them when they do).
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*deprecated")
            quantized = torch.quantize_per_channel(
                weight, scales.double(), torch.zeros(out_features, dtype=torch.long), 0, torch.qint8
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


def _replace_linears(
    model: CausalLM, make: Callable[[torch.Tensor, Optional[torch.Tensor]], nn.Module], skip: Sequence[str]
) -> Replaced:
    """Replace, in place, every ``Linear`` whose module name matches no pattern of ``skip`` (fnmatch),
    and the output head (tied: a copy of the embedding table), by ``make(weight, bias)``."""
    replaced: Replaced = []
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            full_name = f"{path}.{name}" if path else name
            if isinstance(child, Linear) and not any(fnmatch.fnmatch(full_name, p) for p in skip):
                replaced.append((module, name, child))
                setattr(module, name, make(child.weight, child.bias))
    if model.lm_head is None:
        replaced.append((model, "lm_head", None))
        model.lm_head = make(model.embedding.weight, None)  # type: ignore[assignment]
    return replaced


#: ``packed_linears``'s copies: weight -> (the weight's and bias's addresses and versions when
#: packed, the packed module). Weak keys: a copy goes when its weight does.
_PACKED = WeakIdKeyDictionary()


def _cached_pack(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> PackedLinear:
    """``PackedLinear(weight, bias)``, reused from an earlier call while ``weight`` and ``bias`` are
    the same tensors, unmodified: an optimizer step or a load bumps their versions, a new tensor
    has another address, and either packs afresh."""
    stamp = tuple(v for t in (weight, bias) if t is not None for v in (t.data_ptr(), t._version))
    cached = _PACKED.get(weight)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    packed = PackedLinear(weight, bias)
    _PACKED[weight] = (stamp, packed)
    return packed


def can_pack(model: CausalLM) -> bool:
    """Whether ``packed_linears`` applies: float32 weights on a CPU with oneDNN."""
    parameter = next(model.parameters())
    return parameter.device.type == "cpu" and parameter.dtype == torch.float32 and torch.backends.mkldnn.is_available()


@contextlib.contextmanager
def packed_linears(model: CausalLM) -> Iterator[CausalLM]:
    """``pack_linears`` for the duration of a ``with`` block; the model's own modules are put back
    afterwards, so the caller's model still trains and saves. The packed copies stay for the next
    block (``_cached_pack``): a weight changed in between is packed again."""
    _on_the_cpu(model, "oneDNN packing")
    with torch.no_grad():
        replaced = _replace_linears(model, _cached_pack, skip=())
    try:
        yield model
    finally:
        for parent, name, original in reversed(replaced):
            if original is None:
                delattr(parent, name)  # a tied head: back to the plain attribute ``None`` it was
            setattr(parent, name, original)


@torch.no_grad()
def pack_linears(model: CausalLM) -> CausalLM:
    """Every float32 ``Linear`` and the output head as a ``PackedLinear``; what is already int8 stays."""
    _on_the_cpu(model, "oneDNN packing")
    _replace_linears(model, PackedLinear, skip=())
    return model.eval()


@torch.no_grad()
def quantize_int8(model: CausalLM, skip: Sequence[str] = DEFAULT_SKIP) -> CausalLM:
    """Every ``Linear`` and the output head as an ``Int8Linear``, except the linears whose module
    names match a pattern of ``skip`` (fnmatch)."""
    _on_the_cpu(model, "int8 decoding (fbgemm kernels)")
    _replace_linears(model, Int8Linear, skip)
    return model.eval()
