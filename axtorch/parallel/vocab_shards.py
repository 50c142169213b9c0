"""An output head split over its vocabulary rows (tensor parallelism's column-parallel head): this
process's rows, where they start, and the reductions over the processes that hold the others.

With it the fused loss (``axtorch/train/head_cross_entropy.py``) takes the softmax over the whole
vocabulary from each process's rows and two small reductions per chunk of tokens, as Megatron's
vocabulary-parallel cross-entropy does, instead of gathering the ``[vocab, dim]`` head and keeping
its whole gradient on every process (7.83 GiB a device for llama3_70b at ``mesh.model=8``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from axtorch.parallel.tensor_shards import is_distributed

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass
class VocabShard:
    """This process's rows of a head split over one mesh dimension, as plain tensors whose gradients
    return to the head's own shards."""

    weight: torch.Tensor  # [rows, dim]
    bias: Optional[torch.Tensor]  # [rows]
    offset: int  # the first row's index in the vocabulary
    group: dist.ProcessGroup  # the processes holding the other rows

    # Collectives stay eager inside a compiled chunk of the loss (``head_cross_entropy``'s ``compiled``).
    @torch.compiler.disable
    def reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    @torch.compiler.disable
    def reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor


def vocab_shard(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[VocabShard]:
    """The local rows of a head whose weight (and bias) are split over their rows on a one-dimensional
    mesh (what FSDP hands a tensor-parallel head in its forward); None for any other head."""
    if not is_distributed(weight) or weight.device_mesh.ndim != 1 or not _split_by_rows(weight):
        return None
    if bias is not None and not (is_distributed(bias) and _split_by_rows(bias)):
        return None
    mesh = weight.device_mesh
    # DTensor splits rows as torch.chunk does: ceil(vocab / processes) each, the last ones short.
    offset = min(mesh.get_local_rank() * -(-weight.shape[0] // mesh.size()), weight.shape[0])
    local_bias = None if bias is None else bias.to_local()
    return VocabShard(weight.to_local(), local_bias, offset, mesh.get_group())


def _split_by_rows(tensor: DTensor) -> bool:
    from torch.distributed.tensor import Shard

    return tuple(tensor.placements) == (Shard(0),)
