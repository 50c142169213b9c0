"""Key/value cache for incremental decoding, one per attention layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class KVCache:
    """Preallocated keys and values, with the absolute position held in each slot.

    ``keys`` and ``values`` are [B, H_kv, slots, head_dim]. A full cache has one slot per position.
    A ring cache, for attention that sees only the last ``window`` positions, writes position
    ``p`` to slot ``p % slots``, so its memory stays bounded however long decoding runs. Shapes
    never change, which keeps decoding friendly to compiled graphs (XLA, CUDA graphs).
    """

    keys: torch.Tensor
    values: torch.Tensor
    #: [B, slots] the absolute position whose keys each slot holds. Slots not yet written hold
    #: their own index, a position still in every query's future, so masks exclude them.
    slot_positions: torch.Tensor
    #: The window of a ring cache; None for a full cache.
    window: Optional[int] = None

    @classmethod
    def allocate(
        cls,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        window: Optional[int] = None,
        max_write: Optional[int] = None,
    ) -> KVCache:
        """A cache for positions below ``max_len``, written at most ``max_write`` tokens at a time.

        With a ``window``, ``window + max_write - 1`` slots suffice (when fewer than ``max_len``):
        after any write, every key that the write's queries can see is still held.
        """
        slots = max_len
        if window is not None and max_write is not None and window + max_write - 1 < max_len:
            slots = window + max_write - 1
        else:
            window = None  # as many slots as positions: a plain full cache
        shape = (batch_size, num_kv_heads, slots, head_dim)
        slot_positions = torch.arange(slots, device=device).expand(batch_size, -1).clone()
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            slot_positions,
            window,
        )

    @property
    def max_len(self) -> int:
        """The number of slots (for a full cache, the number of positions)."""
        return self.keys.shape[2]

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys``/``values`` [B, H_kv, S, D] at ``positions`` [B, S]; return the whole cache.

        A full cache needs positions below ``max_len``: the caller that sized it checks its
        lengths on the host, so that a decode step never reads the device. A ring cache needs
        each write's positions to be consecutive, and S no more than it was sized for.
        """
        slots = positions
        if self.window is not None:
            if keys.shape[2] > self.max_len - self.window + 1:
                raise ValueError(
                    f"a ring KV cache of {self.max_len} slots for window {self.window} takes at most "
                    f"{self.max_len - self.window + 1} tokens per call, got {keys.shape[2]}"
                )
            slots = positions % self.max_len
            self.slot_positions.scatter_(1, slots, positions)
        index = slots[:, None, :, None].expand_as(keys)
        self.keys.scatter_(2, index, keys.to(self.keys.dtype))
        self.values.scatter_(2, index, values.to(self.values.dtype))
        return self.keys, self.values

    def slot(self, position: int) -> int:
        """The slot ``update`` writes position ``position`` to, for a position already on the host
        (a compiled decode step that writes the cache itself); refused past a full cache's end."""
        slot = position if self.window is None else position % self.max_len
        if not 0 <= slot < self.max_len:
            raise ValueError(f"position {position} is past the KV cache's {self.max_len} slots")
        return slot

    def key_positions(self) -> torch.Tensor:
        """[B, slots] absolute position of every cache slot."""
        return self.slot_positions
