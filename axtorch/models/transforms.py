"""Model transforms: changes to a built model that its config names and one function applies.

A transform rewrites modules of a model built from its config, in place and on the meta device,
before a backend shards it: float8 training linears (``model/float8``) are one. Each has its
inverse (``restore``), which export and inference apply (``restore_model_transforms``), so that
what they read is the model's own layers whatever the run trained with. A transform that
rewrites the weights' values (an int8 frozen base, ``model/frozen_base``) says so
(``needs_values``) and runs instead once they are loaded, before the optimizer is built. The config lists
its transforms (``CausalLMConfig.transforms()``) and ``apply_model_transforms`` applies them, so
no caller special-cases any one of them. ``CausalLMConfig.build()`` stays the layers as
configured: inference from a run, and the seeded initial values, do not depend on training
transforms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn


class ModelTransform(Protocol):
    def apply(self, model: nn.Module) -> list[str]:
        """Rewrite ``model`` in place; returns the qualified names of the modules it changed."""
        ...

    def restore(self, model: nn.Module) -> list[str]:
        """The inverse, for export and inference: the modules ``apply`` changed back to the model's
        own layers computing the same function (an adapter merged into its linear's weight, a
        float8 or int8 linear a ``Linear`` again); returns their names."""
        ...


@dataclass
class ModelTransformConfig:
    """A transform's settings: a slot type of ``CausalLMConfig`` (e.g. ``model.float8``)."""

    #: Whether ``apply`` needs the model's loaded values rather than its structure on the meta device.
    needs_values: ClassVar[bool] = False

    def validate(self, key: str) -> None:
        """Raise ``ConfigError`` for settings this torch build cannot run."""

    def build(self, device: torch.device) -> ModelTransform:
        """The transform for a model that runs on ``device`` (float8 emulates where it has no float8 matmul)."""
        raise NotImplementedError(f"{type(self).__name__} must build its transform")


def apply_model_transforms(
    transforms: Sequence[ModelTransformConfig], model: nn.Module, device: torch.device, loaded: bool = False
) -> None:
    """Apply, in order, each of ``transforms`` whose ``needs_values`` is ``loaded``: those of the
    meta-device model before its values are loaded, or those of the loaded one, which will run on ``device``."""
    for config in transforms:
        if config.needs_values == loaded:
            config.build(device).apply(model)


def restore_model_transforms(transforms: Sequence[ModelTransformConfig], model: nn.Module) -> None:
    """Undo ``transforms``, the last applied first, on a model on the CPU: the model as its config
    builds it (``CausalLMConfig.build()``), with what training changed in its weights."""
    for config in reversed(transforms):
        config.build(torch.device("cpu")).restore(model)


def replace_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` in place of ``model``'s submodule ``name`` (qualified: ``decoder.layers.0.attention.q_proj``)."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)
