"""Seams: the parts of a layer that a backend may replace, declared by the layer itself.

A layer lists its seams in a class attribute, ``SEAMS``: each slot's attribute name and the
``Protocol`` its implementation follows. Its ``__init__`` sets every slot to the default
implementation (what one device runs), so a reader of the layer sees everything that may change
how it runs, and the model works unchanged without a backend. A backend fills slots by their
protocol (``fill_seams(model, ExpertCompute, compute)``), never by attribute names or duck
typing; a slot no layer declares cannot be filled (``tests/health/test_declared_seams.py``
checks that backends change modules only this way).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

#: A layer's declared slots: attribute name -> the ``runtime_checkable`` Protocol it follows.
Seams = Mapping[str, type]


def declared_seams(module: nn.Module) -> dict[str, type]:
    """The slots ``module``'s class (and its bases) declare in ``SEAMS``."""
    seams: dict[str, type] = {}
    for cls in reversed(type(module).__mro__):
        seams.update(vars(cls).get("SEAMS", {}))
    return seams


def modules_with_seam(model: nn.Module, protocol: type) -> Iterator[tuple[str, nn.Module, str]]:
    """``(module name, module, slot name)`` of every slot in ``model`` declared with ``protocol``.

    A backend finds the layers it serves this way, whatever their class (any mixture of experts
    that declares an ``ExpertCompute`` slot, say).
    """
    for module_name, module in model.named_modules():
        for slot, declared in declared_seams(module).items():
            if declared is protocol:
                yield module_name, module, slot


def fill_seams(model: nn.Module, protocol: type, implementation: Any) -> int:
    """Put ``implementation`` into every slot of ``model``'s modules declared with ``protocol``.

    Returns how many slots were filled (0: no layer of this model has such a seam).
    """
    if not isinstance(implementation, protocol):
        raise TypeError(f"{type(implementation).__name__} does not implement {protocol.__name__}")
    slots = list(modules_with_seam(model, protocol))
    for _, module, slot in slots:
        setattr(module, slot, implementation)
    return len(slots)
