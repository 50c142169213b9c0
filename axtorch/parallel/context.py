"""Context parallelism for the native backend: the sequence split over the ``seq`` mesh axis.

Each process of a ``seq`` group holds a slice of every sequence's tokens and runs the whole model
on them; attention alone needs the other slices, and gets them by gathering keys and values
(with their absolute positions) from the group (``GatheredSequence``). The mask compares
positions, so rotary embeddings, causal and sliding-window masks and ALiBi see global positions
and the losses equal one device's. Packed documents (``data.document_masking``) keep their own
positions, which restart in each document, and their segment ids are gathered with the keys: within
a document, positions order the tokens as the sequence does, so the masks stay exact.

Causal attention gives late tokens more keys than early ones. So that every process does the
same work, the sequence is cut into ``2 x seq`` chunks and process ``r`` takes chunks ``r`` and
``2 x seq - 1 - r`` (the "zigzag" balance of ring-attention implementations).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def zigzag_indices(seq_len: int, parts: int, part: int) -> torch.Tensor:
    """The token indices of part ``part`` of ``parts``: chunks ``part`` and ``2 parts - 1 - part``."""
    if seq_len % (2 * parts):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into 2 x {parts} equal chunks")
    chunk = seq_len // (2 * parts)
    early = torch.arange(part * chunk, (part + 1) * chunk)
    late = torch.arange((2 * parts - 1 - part) * chunk, (2 * parts - part) * chunk)
    return torch.cat([early, late])


def split_sequence(batch: dict[str, torch.Tensor], parts: int, part: int) -> dict[str, torch.Tensor]:
    """This part's tokens of every [B, S] tensor of ``batch``, with their ``positions``: the batch's
    own (packed documents), else their absolute indices."""
    rows, seq_len = batch["input_ids"].shape
    indices = zigzag_indices(seq_len, parts, part)
    local = {key: tensor[:, indices] for key, tensor in batch.items()}
    if "positions" not in batch:
        local["positions"] = indices.expand(rows, -1).clone()
    return local


class _GatherAlongSequence(torch.autograd.Function):
    """All-gather along dim 2 ([B, H, S, D]); backward: sum every process's gradient, keep the own slice.

    Written out rather than ``torch.distributed.nn.functional.all_gather``, whose gradients are
    silently wrong on gloo when the incoming gradient is not contiguous.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.size = local.shape[2]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # gloo has no reduce-scatter: an all-reduce, then this process's slice.
        summed = grad.contiguous()
        dist.all_reduce(summed, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.size
        return summed[:, :, start : start + ctx.size].contiguous(), None


class GatheredSequence:
    """A ``SequenceExchange`` (attention's seam): every process's keys, values, key positions and
    key segment ids, in group order.

    Every layer of a forward gets the same positions (and segment ids) tensor, so what is gathered
    of it is kept and reused: one exchange of positions per forward, not one per layer.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._gathered: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # kind -> (local, gathered)

    def __call__(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, segment_ids: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        gather = _GatherAlongSequence.apply
        key_segments = None if segment_ids is None else self._gather_once("segment_ids", segment_ids)
        key_positions = self._gather_once("positions", positions)
        return gather(keys, self.group), gather(values, self.group), key_positions, key_segments

    def _gather_once(self, kind: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` [B, S_local] gathered along the sequence, once per tensor."""
        kept = self._gathered.get(kind)
        if kept is None or kept[0] is not local:
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, local.contiguous(), group=self.group)
            kept = (local, torch.cat(parts, dim=1))
            self._gathered[kind] = kept
        return kept[1]
