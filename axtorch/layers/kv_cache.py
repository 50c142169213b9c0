"""Key/value cache for incremental decoding, one per attention layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Preallocated keys and values, indexed by absolute position.

    ``keys`` and ``values`` are [B, H_kv, max_len, head_dim]. A step writes its new keys at its
    positions; shapes never change, which keeps decoding friendly to compiled graphs (XLA).
    """

    keys: torch.Tensor
    values: torch.Tensor

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
    ) -> KVCache:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys``/``values`` [B, H_kv, S, D] at ``positions`` [B, S]; return the whole cache.

        Positions must lie below ``max_len``: the caller that sized the cache checks its lengths
        on the host, so that a decode step never reads the device.
        """
        index = positions[:, None, :, None].expand_as(keys)
        self.keys.scatter_(2, index, keys.to(self.keys.dtype))
        self.values.scatter_(2, index, values.to(self.values.dtype))
        return self.keys, self.values

    def key_positions(self) -> torch.Tensor:
        """[B, max_len] absolute position of every cache slot."""
        batch = self.keys.shape[0]
        return torch.arange(self.max_len, device=self.keys.device).expand(batch, -1)
