"""Adapters: parameter-efficient fine-tuning of a frozen model (``model/adapter=lora``).

An adapter is a model transform (``axtorch.models.transforms``), as float8 is: the model's
config names it in ``model.adapter`` and the trainer applies it to the built model before a
backend shards it. It gives every ``Linear`` whose qualified name matches ``target`` (searched,
e.g. ``attention\\.(q|v)_proj``) a fresh adapter child (``Linear.adapter``) and freezes every
other parameter, so the optimizer, the gradients and the checkpoints hold only the adapters.

Why a transform rather than a field of ``LinearConfig``: one ``LinearConfig`` serves the query,
key and value projections alike (``AttentionConfig.qkv_projection``), so a per-config adapter
could not tell ``q_proj`` from ``k_proj``; the module names can, and the same pattern works for
every model family. The adapter itself is still a composed child of the linear layer, and
``merge_adapters`` folds it into the linear's weight for export and inference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from axtorch.config.errors import ConfigError
from axtorch.layers.init import initialize_parameters
from axtorch.layers.linear import Linear, LinearAdapter
from axtorch.models.transforms import ModelTransformConfig


@dataclass
class AdapterConfig(ModelTransformConfig):
    """Slot type for ``model.adapter``; None (the default) trains every parameter."""

    #: Regex searched in each ``Linear``'s qualified name (``decoder.layers.0.attention.q_proj``).
    target: str = r"attention\.(q|v)_proj"

    def validate(self, key: str = "model.adapter") -> None:
        try:
            re.compile(self.target)
        except re.error as error:
            raise ConfigError(f"{key}.target", self.target, "a Python regular expression", reason=str(error)) from error

    def build_adapter(self, in_features: int, out_features: int) -> nn.Module:
        """One adapter (a ``LinearAdapter``) for a linear of these features."""
        raise NotImplementedError(f"{type(self).__name__} must build its adapter")

    def build(self, device: torch.device) -> LinearAdapters:
        return LinearAdapters(self)


class LinearAdapters:
    """A ``ModelTransform``: adapters on the target linears, every other parameter frozen."""

    def __init__(self, config: AdapterConfig):
        self.config = config

    def apply(self, model: nn.Module) -> list[str]:
        """Attach adapters in place (works on the meta device); returns the adapted linears' names."""
        pattern = re.compile(self.config.target)
        names = [name for name, module in model.named_modules() if isinstance(module, Linear) and pattern.search(name)]
        if not names:
            linears = [name for name, module in model.named_modules() if isinstance(module, Linear)]
            raise ConfigError(
                "model.adapter.target",
                self.config.target,
                "a regex found in some linear layer's name",
                reason=f"it matches none of the model's linears, e.g. {linears[:3]}",
            )
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        device = next(model.parameters()).device
        for name in names:
            linear = model.get_submodule(name)
            assert isinstance(linear, Linear)
            with device:
                linear.adapter = self.config.build_adapter(linear.in_features, linear.out_features)
            if device.type != "meta":  # on the meta device (the trainer's), materialize fills them
                initialize_parameters(linear.adapter)
        return names

    def restore(self, model: nn.Module) -> list[str]:
        """Every adapter merged into its linear's weight: the same function, as plain linears."""
        return merge_adapters(model)


def adapted_linears(model: nn.Module) -> list[tuple[str, Linear]]:
    """``(name, linear)`` of every linear that holds an adapter."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear) and m.adapter is not None]


def adapters(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, adapter)`` of every adapter (a ``LinearAdapter``), whichever linear holds it (float8's too)."""
    return [(name, cast(nn.Module, m)) for name, m in model.named_modules() if isinstance(m, LinearAdapter)]


def merge_adapters(model: nn.Module) -> list[str]:
    """Fold every adapter into its ``Linear``'s weight (for export and inference); returns their
    names. A float8 or int8 base is made a ``Linear`` first (``restore_model_transforms``)."""
    adapted = adapted_linears(model)
    for _, linear in adapted:
        linear.merge_adapter()
    return [name for name, _ in adapted]
