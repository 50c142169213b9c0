"""Pieces of (possibly distributed) tensors: which block a process owns, and reassembly of any block.

A checkpoint stores every tensor as one or more pieces, each a block of the global tensor at some
offsets. A process saving a DTensor writes only its local block, and only if it is the first
replica of that block; a process loading reads exactly the block its target layout needs, from
whichever stored pieces overlap it. So a checkpoint written under one mesh loads under any other,
and no process ever holds more than its own share.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeGuard

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

#: DTensor's module: until a backend imports it, no tensor can be a DTensor. Importing it costs a
#: second of every process's start-up (sympy, through DTensor's sharding propagation), which a
#: single-device run, the planner and the CLI's other commands need not pay.
_DTENSOR_MODULE = "torch.distributed.tensor"


@dataclass
class Piece:
    tensor: torch.Tensor  # the block's values
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def is_distributed(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    module = sys.modules.get(_DTENSOR_MODULE)
    return module is not None and isinstance(tensor, module.DTensor)


def local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offsets) of the block of the global tensor that this process holds."""
    if is_distributed(tensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        return compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(tensor.shape), (0,) * tensor.dim()


def owned_pieces(tensor: torch.Tensor, rank: int) -> list[Piece]:
    """The blocks this process stores: its local block if it is that block's first replica."""
    piece = owned_piece(tensor, rank)
    return [] if piece is None else [piece]


def owned_piece(tensor: torch.Tensor, rank: int) -> Optional[Piece]:
    """This process's block if it is the one to store it (first replica), else None."""
    if is_distributed(tensor):
        from torch.distributed.tensor import Replicate

        coordinate = tensor.device_mesh.get_coordinate()
        if coordinate is None or any(
            isinstance(p, Replicate) and c != 0 for p, c in zip(tensor.placements, coordinate)
        ):
            return None
        local = tensor.to_local()
    elif rank != 0:
        return None
    else:
        local = tensor
    _, offsets = local_region(tensor)
    return Piece(host_copy(local), tuple(tensor.shape), tuple(offsets))


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy that later updates of ``tensor`` cannot change.

    From CUDA the copy goes into pinned memory without blocking; it is complete only after
    ``torch.cuda.synchronize()``, which the caller runs once for all its copies. Pinned blocks come
    from torch's caching host allocator, so each save reuses the memory of the one before.
    """
    tensor = tensor.detach()
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)
    if tensor.device.type == "cpu":
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.to("cpu").contiguous()


def read_block(
    directory: Path, entry: dict[str, Any], name: str, shape: tuple[int, ...], offsets: tuple[int, ...]
) -> torch.Tensor:
    """The block ``[offsets, offsets + shape)`` of tensor ``name``, assembled from its stored pieces."""
    block: Optional[torch.Tensor] = None
    covered = 0
    for piece in entry["pieces"]:
        lows = [max(o, p) for o, p in zip(offsets, piece["offsets"])]
        highs = [min(o + s, p + ps) for o, s, p, ps in zip(offsets, shape, piece["offsets"], piece["shape"])]
        if any(lo >= hi for lo, hi in zip(lows, highs)):
            continue
        with safe_open(directory / piece["file"], framework="pt") as handle:
            stored = handle.get_slice(piece.get("key", name))
            values = stored[tuple(slice(lo - p, hi - p) for lo, hi, p in zip(lows, highs, piece["offsets"]))]
        if block is None:
            block = torch.empty(shape, dtype=values.dtype)
        block[tuple(slice(lo - o, hi - o) for lo, hi, o in zip(lows, highs, offsets))] = values
        covered += values.numel()
    if block is None or covered < block.numel():
        raise ValueError(f"checkpoint pieces of {name} do not cover block {offsets}+{shape}")
    return block


def load_into(target: torch.Tensor, directory: Path, entry: dict[str, Any], name: str) -> None:
    """Copy the stored values of ``name`` into ``target``'s local block, in place."""
    if tuple(entry["shape"]) != tuple(target.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(entry['shape'])} != model shape {tuple(target.shape)}")
    shape, offsets = local_region(target)
    _copy_local(target, read_block(directory, entry, name, tuple(shape), tuple(offsets)))


def copy_into_local_block(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy ``target``'s own block of the global value ``whole`` into ``target``, in place."""
    if tuple(whole.shape) != tuple(target.shape):
        raise ValueError(f"value of shape {tuple(whole.shape)} for a tensor of shape {tuple(target.shape)}")
    shape, offsets = local_region(target)
    _copy_local(target, whole[tuple(slice(o, o + s) for o, s in zip(offsets, shape))])


def _copy_local(target: torch.Tensor, block: torch.Tensor) -> None:
    local = target.to_local() if is_distributed(target) else target
    with torch.no_grad():
        local.copy_(block)
