"""Activation checkpointing (remat): trade recomputation in backward for activation memory.

``RematConfig`` is the slot type of the decoder's per-layer policy (``model/remat``); with none
chosen, every activation a layer's backward needs is kept (fastest, most memory). Otherwise:

* ``full`` keeps only each layer's input and recomputes the layer in backward;
* ``selective`` keeps the activations that layers compute inside ``activation_name`` scopes
  named in ``save`` and recomputes the rest (AXLearn's ``save_only_these_names``): the ops of a
  kept scope are not rerun in backward.

Layers name activations and never see the policy: the same model runs under any policy, and
gradients are identical under all of them. A layer's config declares the names its layer gives,
with their widths (``activation_widths``: name -> features per token on one device); that one
declaration is what a selective policy's ``save`` is checked against (a name no layer of the
model gives is a ``ConfigError``) and what the planner counts as kept. Remat applies only where
gradients are being recorded; evaluation and decoding run layers directly.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from axtorch.config.errors import ConfigError

#: A layer's declaration of the activations it names (``activation_name``): name -> features per
#: token on one device (under ``tensor_parallel``), which a selective policy listing the name keeps.
ActivationWidths = dict[str, float]

_current_name: Optional[str] = None  # read by the selective policy as each op dispatches


def combine_widths(*declarations: Mapping[str, float]) -> ActivationWidths:
    """The declaration of a layer made of sublayers: a name several of them give keeps all of theirs."""
    total: Counter[str] = Counter()
    for declaration in declarations:
        total.update(declaration)
    return dict(total)


def current_activation_name() -> Optional[str]:
    """The name of the activations being computed now (None outside every ``activation_name`` scope)."""
    return _current_name


class activation_name:  # lower case: used as a function is, ``with activation_name(...)``
    """Name the activations computed inside: ``with activation_name("attention_context"): ...``.

    Costs next to nothing (a class, not a generator: a decode step enters seven a layer); a
    selective remat policy that lists ``name`` keeps these ops' outputs.
    """

    __slots__ = ("name", "previous")

    def __init__(self, name: str):
        self.name = name
        self.previous: Optional[str] = None

    def __enter__(self) -> None:
        global _current_name
        self.previous, _current_name = _current_name, self.name

    def __exit__(self, *exc_info: object) -> None:
        global _current_name
        _current_name = self.previous


@dataclass
class RematConfig:
    """Slot type for the per-layer remat policy; build with ``build()``."""

    #: Whether it chooses what to keep with torch's selective-checkpoint policy contexts, which stop
    #: under torch_xla (its functionalization's ``aten.detach_copy`` is not among what they saved).
    uses_policy_contexts: ClassVar[bool] = False

    def validate(self, key: str, named: Collection[str]) -> None:
        """``named``: the activation names the model's layers declare (``activation_widths``)."""

    def build(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} is a slot type: choose a concrete remat config")


@dataclass
class FullRematConfig(RematConfig):
    def build(self) -> FullRemat:
        return FullRemat()


@dataclass
class SelectiveRematConfig(RematConfig):
    uses_policy_contexts: ClassVar[bool] = True
    #: Named activations to keep (names the model's layers declare); everything else is recomputed.
    #: The default suits every preset: dense feed-forwards and mixtures of experts both name
    #: their hidden activations ``feed_forward_hidden``.
    save: list[str] = field(default_factory=lambda: ["attention_context", "feed_forward_hidden"])

    def validate(self, key: str, named: Collection[str]) -> None:
        unknown = sorted(set(self.save) - set(named))
        if unknown:
            raise ConfigError(
                f"{key}.save", unknown, f"names that this model's layers give activations: {sorted(named)}"
            )

    def build(self) -> SelectiveRemat:
        return SelectiveRemat(self)


class FullRemat(nn.Module):
    """Keep the layer's input only; recompute the layer in backward."""

    def forward(self, layer: Callable[[Any], Any], inputs: Any) -> Any:
        if not torch.is_grad_enabled():
            return layer(inputs)
        return checkpoint(layer, inputs, use_reentrant=False)


class SelectiveRemat(nn.Module):
    """Keep the activations named in the config; recompute the rest in backward."""

    def __init__(self, config: SelectiveRematConfig):
        super().__init__()
        self.save = frozenset(config.save)
        self._context = functools.partial(create_selective_checkpoint_contexts, self._policy)

    def _policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return (
            CheckpointPolicy.MUST_SAVE if current_activation_name() in self.save else CheckpointPolicy.PREFER_RECOMPUTE
        )

    def forward(self, layer: Callable[[Any], Any], inputs: Any) -> Any:
        if not torch.is_grad_enabled():
            return layer(inputs)
        return checkpoint(layer, inputs, use_reentrant=False, context_fn=self._context)

    def extra_repr(self) -> str:
        return f"save={sorted(self.save)}"
