"""A second line between processes, for work that runs beside training (a checkpoint writer thread).

Collectives on one process group must be issued in the same order on every rank; a background
thread that gathered on the training's own group would interleave with the training thread's
all-reduces differently on each rank and deadlock. So the writer coordinates on a gloo group of
its own, created once, collectively, when the checkpointer is built (as DCP's async save does).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist


class Coordinator(Protocol):
    """Barriers and object gathers across every process of the job."""

    rank: int
    world_size: int

    def barrier(self) -> None: ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, in rank order, on every process."""


class GlooSideChannel:
    """A ``Coordinator`` on a gloo group of its own; every process must build it at the same point."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = dist.new_group(backend="gloo")

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered
