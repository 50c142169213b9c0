"""Weight-only int8 for frozen linears: one float32 scale per output channel, float activations.

``quantize_per_channel_int8`` is the one rounding rule of the project: each row of a weight is
scaled so that its largest magnitude maps to 127 and rounded to the nearest integer. Inference's
``Int8Linear`` (``axtorch.infer.cpu_weights``, fbgemm's dynamic quantization) stores its weights
by it, and so does ``FrozenInt8Linear``, the training form of a frozen base's linear
(``model/frozen_base=int8``): a quarter of the weight's bytes, dequantised on every call.

``FrozenInt8Linear`` has no weight gradient at all: its product is a custom autograd function
that saves the int8 weight and its scales (not the float32 weight, which would undo the saving
for as long as the backward pass needs it) and returns only the input's gradient, which the
adapters of earlier layers need.
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from axtorch.layers.linear import Linear, plus_adapter


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: int8 [out, in] and float32 [out] with ``weight ~= q * scale[:, None]``.

    Each output channel's scale is its largest magnitude over 127 (a row of zeros gets the
    smallest normal float, so nothing divides by zero); ``q`` rounds half to even.
    """
    weight = weight.detach().float()
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(weight / scale[:, None]).to(torch.int8)  # |weight / scale| <= 127 by the scale's choice
    return q, scale


def dequantize_per_channel_int8(
    q: torch.Tensor, scale: torch.Tensor, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The float32 weight that ``(q, scale)`` stands for (written into ``out`` when given).

    Converted in place, then scaled: ``torch.mul(q, scale)`` would first copy ``q`` to float32.
    """
    weight = q.float() if out is None else out.copy_(q)
    return weight.mul_(scale[:, None])


class DequantizationScratch:
    """One float32 buffer per weight shape and device, which a model's frozen int8 linears dequantise into in turn.

    A dequantised weight lives only for its own product, so one buffer serves every linear of a
    shape. A fresh weight-sized temporary per call would be a new block for the C allocator to map
    and fault in, or a hole between the activations the forward keeps (SmolLM2-135M's LoRA steps
    peaked 80 MiB higher with them). Sharing is safe because the products run one at a time (one
    device, one stream: ``model.frozen_base`` is single-device only).
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.Size], torch.Tensor] = {}

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The weight, in the shared buffer; in a fresh tensor under torch.compile (``trainer.compile``),
        whose graph may keep it for the backward, where the next linear would overwrite a shared one."""
        if torch.compiler.is_compiling():
            return dequantize_per_channel_int8(q, scale)
        key = (q.device, q.shape)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(q.shape, device=q.device)
        return dequantize_per_channel_int8(q, scale, out=self.buffers[key])


class _Int8WeightProduct(torch.autograd.Function):
    """``x W^T + b`` with ``W`` dequantised from int8 in the forward and again in the backward."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: Optional[torch.Tensor],
        scratch: DequantizationScratch,
    ) -> torch.Tensor:
        ctx.save_for_backward(q, scale)
        ctx.scratch = scratch
        return F.linear(x, scratch.dequantize(q, scale), bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None, None]:
        q, scale = ctx.saved_tensors
        grad_input = grad_output @ ctx.scratch.dequantize(q, scale).to(grad_output.dtype)
        return grad_input, None, None, None, None


class FrozenInt8Linear(nn.Module):
    """A frozen ``Linear`` whose weight is stored as int8 with per-channel scales; its adapter still trains.

    The int8 weight and its scales are non-persistent buffers: a checkpoint of the run holds
    the adapters only, as with a float32 base, and the base is rebuilt from where it came from.
    ``bias`` (frozen) and ``adapter`` are the linear's own objects, so parameter names stay. The
    linears of one model share one ``scratch`` (a fresh one by default).
    """

    weight_int8: torch.Tensor  # [out_features, in_features] int8
    weight_scale: torch.Tensor  # [out_features] float32

    def __init__(self, linear: Linear, scratch: Optional[DequantizationScratch] = None):
        super().__init__()
        self.config = linear.config
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        q, scale = quantize_per_channel_int8(linear.weight)
        self.register_buffer("weight_int8", q, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
        self.bias = linear.bias
        self.adapter: Optional[nn.Module] = linear.adapter
        self.scratch = scratch or DequantizationScratch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        product = _Int8WeightProduct.apply(x, self.weight_int8, self.weight_scale, self.bias, self.scratch)
        return plus_adapter(self, x, cast(torch.Tensor, product))

    def active_parameter_count(self) -> int:
        """The weights a token multiplies with (``axtorch.train.flops``): the int8 ones count as any other."""
        return self.weight_int8.numel() + sum(p.numel() for p in self.parameters())

    def to_linear(self) -> Linear:
        """A ``Linear`` holding the dequantised weight, the same bias and adapter: the function this one computes."""
        with torch.device("meta"):
            linear = Linear(self.config, self.in_features, self.out_features)
        weight = dequantize_per_channel_int8(self.weight_int8, self.weight_scale)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        linear.bias = self.bias
        linear.adapter = self.adapter
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
