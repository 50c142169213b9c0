"""Int8 weights for decoding on a CPU: every linear layer, and the output head, in a quarter of the bytes.

Decoding one token reads every weight once, so on a CPU it runs at the speed of memory. With
``quantize_int8`` each chosen weight matrix is stored as int8 with one scale per output channel, and
each call quantizes its activations to int8 on the fly (PyTorch's dynamic quantization on the
fbgemm / x86 kernels). Mixture-of-experts weights, stored stacked rather than as linear layers,
stay in float32. Only for inference on the CPU: the quantized model has no gradients.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from axtorch.layers.linear import Linear
from axtorch.models.causal_lm import CausalLM


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


@torch.no_grad()
def quantize_int8(model: CausalLM, skip: Sequence[str] = DEFAULT_SKIP) -> CausalLM:
    """Replace, in place, every ``Linear`` and the output head (tied or not) by an ``Int8Linear``,
    except the linears whose module names match a pattern of ``skip`` (fnmatch)."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 decoding runs on the CPU (fbgemm kernels); move the model to the CPU first")
    for path, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            full_name = f"{path}.{name}" if path else name
            if isinstance(child, Linear) and not any(fnmatch.fnmatch(full_name, p) for p in skip):
                setattr(module, name, Int8Linear(child.weight, child.bias))
    if model.lm_head is None:  # tied: the head gets an int8 copy of the embedding table
        model.lm_head = Int8Linear(model.embedding.weight, None)  # type: ignore[assignment]
    return model.eval()
