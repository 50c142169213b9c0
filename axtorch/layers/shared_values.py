"""Values that every layer of one forward would compute alike, computed once and shared.

In a KV-cache decode step each layer rebuilds the same small tensors from the same positions:
the rotary cos/sin tables and the attention mask. At batch 1 the matmuls are memory-bound and
short, so these dozens of small ops a layer are a sizeable share of the step. The decoder hands
one ``SharedValues`` to all its layers for one forward (``DecoderInput``), and a child that
computes such a value asks for it by a key that names everything the value depends on besides the
forward's own positions; the first layer computes it, the others reuse it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

Value = TypeVar("Value")


class SharedValues:
    """A per-forward store: ``get(key, compute)`` runs ``compute`` for the first caller of ``key``.

    A key must name what the value depends on other than the forward's query positions (a
    config's fields, a head size, a tensor's ``id`` that lives as long as the forward).
    """

    def __init__(self) -> None:
        self._values: dict[Hashable, object] = {}

    def get(self, key: Hashable, compute: Callable[[], Value]) -> Value:
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]  # type: ignore[return-value]
