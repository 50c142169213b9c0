"""Run under torchrun by the collective-volume test: one training step, counting what every collective sends.

    torchrun --nproc-per-node N tests/parallel/volume_worker.py OUT_JSON OVERRIDE...

After a warm-up step (lazy state, the pipeline's shape handshake), a ``TorchDispatchMode`` sees
every c10d and functional-collective op of the next step, point-to-point sends included. Each
is priced from its schema, so torch's op names may change: the bytes this process contributes
(its input, its all-reduced tensor, its sent tensor; a receive's buffer), and the bytes that
leave it as a ring algorithm runs the op on its group (none on a group of one). An all-to-all
sends what its split sizes route to the other processes. Rank 0 writes every rank's
``{kind: {"calls", "contributed", "sent"}}``.
"""

import collections
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.parallel.shutdown import exit_process
from axtorch.train.trainer import Trainer

#: Each kind of collective, by the words torch's c10d and functional op names use for it.
KINDS = {
    "all_reduce": ("all_reduce", "allreduce"),
    "all_gather": ("all_gather", "allgather"),
    "reduce_scatter": ("reduce_scatter",),
    "all_to_all": ("all_to_all", "alltoall"),
    "send": ("send",),
    "recv": ("recv",),
}
#: Ops of the collective namespaces that move nothing themselves.
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(item) for item in value)
    return 0


def _kind(op_name: str) -> str:
    kind = next((kind for kind, words in KINDS.items() if any(word in op_name for word in words)), None)
    if kind is None:
        raise NotImplementedError(f"{op_name}: a collective the volume check cannot price")
    return kind


def _group(arguments: dict[str, Any]) -> dist.ProcessGroup:
    if "process_group" in arguments:  # c10d ops hold the group itself
        return dist.ProcessGroup.unbox(arguments["process_group"])
    return _resolve_process_group(arguments["group_name"])  # functional ops name it


def _sent(kind: str, contributed: int, arguments: dict[str, Any]) -> float:
    """Bytes that leave this process: ring all-reduce 2 (n-1)/n of the tensor, ring gather (n-1) shards."""
    group = _group(arguments)
    n = group.size()
    if kind == "all_reduce":
        return 2 * contributed * (n - 1) / n
    if kind == "all_gather":
        return contributed * (n - 1)
    if kind == "reduce_scatter":
        return contributed * (n - 1) / n
    if kind == "all_to_all":
        splits = arguments["input_split_sizes"]
        kept = contributed * splits[group.rank()] / sum(splits) if splits else contributed / n
        return contributed - kept
    return contributed if kind == "send" else 0


class CollectiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.volumes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "c10d" in name and not any(word in name for word in NOT_COLLECTIVES):
            kind = _kind(name)
            arguments = {argument.name: value for argument, value in zip(func._schema.arguments, args)}
            arguments.update(kwargs or {})
            # What this process puts in: c10d's tensors / input_tensor(s), the functional ops' input(s).
            contributed = _bytes(next(v for k, v in arguments.items() if k.startswith("input") or k == "tensors"))
            volume = self.volumes[kind]
            volume["calls"] += 1
            volume["contributed"] += contributed
            volume["sent"] += _sent(kind, contributed, arguments)
        return func(*args, **(kwargs or {}))


def main() -> None:
    out, *overrides = sys.argv[1:]
    trainer = Trainer(load_experiment_config(overrides))
    trainer.train_step(next(trainer.train_batches))  # warm-up: lazy state, first-step set-up
    counter = CollectiveBytes()
    with counter:
        trainer.train_step(next(trainer.train_batches))
    every_rank = trainer.backend.all_gather_object(counter.volumes)
    if trainer.backend.rank == 0:
        with open(out, "w") as handle:
            json.dump(every_rank, handle)
    trainer.backend.close()
    exit_process(0, skip_finalization=True)


if __name__ == "__main__":
    main()
