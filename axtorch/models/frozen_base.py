"""A frozen base stored in int8 while its adapters train (``model/frozen_base=int8``, with ``model/adapter``).

A model transform (``axtorch.models.transforms``) that needs the weights' values: the trainer
applies it after the base is loaded (``init_from`` or the seed) and the adapters are drawn, and
before the optimizer is built. Every frozen ``Linear`` of the decoder becomes a
``FrozenInt8Linear`` (``axtorch.layers.int8_linear``): its weight as int8 with one float32 scale
per output channel, the rule inference's ``Int8Linear`` uses, dequantised on every call, and the
float32 weight released. Activations and the adapters stay float32. What does not convert: the
token embedding and a tied head (a lookup table, and the fused loss reads the head's weight
whole), an untied ``lm_head`` (the same), norms, mixture-of-experts weights (stacked parameters,
not linears) and the linears named in ``skip`` (a router's choice is discrete).

The base stays the one its digest names (``axtorch.train.adapters``): quantising is a function
of it, so a resume or an export rebuilds it exactly. ``float_linears`` turns the converted
linears back into ``Linear`` layers holding the dequantised weights, which export merges the
adapters into: the function the adapters were trained and evaluated with.
"""

from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.int8_linear import DequantizationScratch, FrozenInt8Linear
from axtorch.layers.linear import Linear
from axtorch.models.transforms import ModelTransformConfig, replace_submodule


@dataclass
class FrozenBaseConfig(ModelTransformConfig):
    """Slot type for ``model.frozen_base``; None (the default) keeps the base's weights as loaded."""

    needs_values: ClassVar[bool] = True
    #: The stored format, set by each option (the value ``model/frozen_base=`` names).
    format: ClassVar[str] = ""
    #: Linears whose qualified name contains one of these keep their float weights.
    skip: list[str] = field(default_factory=lambda: ["router"])


@dataclass
class Int8FrozenBaseConfig(FrozenBaseConfig):
    """Weight-only int8, one scale per output channel: a quarter of the base linears' bytes."""

    format: ClassVar[str] = "int8"

    def build(self, device: torch.device) -> Int8FrozenBase:
        return Int8FrozenBase(self)


class Int8FrozenBase:
    """A ``ModelTransform``: the decoder's frozen linears become ``FrozenInt8Linear`` layers."""

    def __init__(self, config: FrozenBaseConfig):
        self.config = config

    def apply(self, model: nn.Module) -> list[str]:
        """Convert in place (the weights must be loaded); returns the converted linears' names."""
        converted = [
            name
            for name, module in model.named_modules()
            if name.startswith("decoder.")
            and isinstance(module, Linear)
            and not module.weight.requires_grad
            and not any(part in name for part in self.config.skip)
        ]
        if not converted:
            raise ConfigError(
                "model.frozen_base.skip",
                self.config.skip,
                "patterns that leave some frozen linear of the decoder to convert",
                reason=f"nothing would be stored in {self.config.format}",
            )
        scratch = DequantizationScratch()  # one per model: its products run one at a time
        on_the_cpu = False
        for name in converted:
            linear = model.get_submodule(name)
            assert isinstance(linear, Linear)
            if linear.weight.is_meta:
                raise ValueError(f"{name}: quantising a frozen base needs its loaded weights, not meta tensors")
            on_the_cpu |= linear.weight.device.type == "cpu"
            replace_submodule(model, name, FrozenInt8Linear(linear, scratch))  # the float32 weight goes with it
        if on_the_cpu:
            _keep_large_allocations_mapped()
        return converted

    def restore(self, model: nn.Module) -> list[str]:
        """Every ``FrozenInt8Linear`` back to a ``Linear`` of its dequantised weight (and its adapter)."""
        return float_linears(model)


def float_linears(model: nn.Module) -> list[str]:
    """Every ``FrozenInt8Linear`` of ``model`` back to a ``Linear`` of its dequantised weight; returns their names."""
    converted = [(name, m) for name, m in model.named_modules() if isinstance(m, FrozenInt8Linear)]
    for name, module in converted:
        replace_submodule(model, name, module.to_linear())
    return [name for name, _ in converted]


#: glibc's ``M_MMAP_THRESHOLD`` option (``mallopt``) and its default: blocks this large or larger
#: are mapped from the kernel on their own, and given back to it when freed.
_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_MMAP_THRESHOLD = -3, 128 * 1024


def _keep_large_allocations_mapped() -> None:
    """Pin glibc's mmap threshold at its default, where freeing the float32 weights would raise it.

    glibc raises the threshold to the size of any mapped block freed (here each released float32
    weight, up to 3.4 MiB in SmolLM2-135M), so that afterwards a step's activations of up to that
    size come from its heap, which the forward's kept activations hole and never give back:
    SmolLM2-135M's LoRA steps then peaked at 1624 MiB on the int8 base, above the float32 base's
    1593, and at 1239 MiB with the threshold pinned (``benchmarks/finetune.py``). A no-op on other
    C libraries; it applies to the whole process, as ``MALLOC_MMAP_THRESHOLD_=131072`` would.
    """
    if platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_MMAP_THRESHOLD)
