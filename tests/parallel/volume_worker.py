"""Run under torchrun by the collective-volume test: one training step, counting every collective's bytes.

    torchrun --nproc-per-node N tests/parallel/volume_worker.py OUT_JSON OVERRIDE...

After a warm-up step, a ``TorchDispatchMode`` sees every c10d and functional-collective op of the
next step and sums the bytes of its first tensor argument (the output buffer of a gather, a
reduce-scatter's output shard, an all-reduce's tensor). Rank 0 writes ``{op: [calls, bytes]}``.
"""

import collections
import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from axtorch.compose.experiment import load_experiment_config
from axtorch.train.trainer import Trainer


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(item) for item in value)
    return 0


class CollectiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "c10d" in name and "wrap_tensor" not in name and "wait" not in name:
            self.calls[name] += 1
            self.bytes[name] += _bytes(args[0] if args else None)
        return func(*args, **(kwargs or {}))


def main() -> None:
    out, *overrides = sys.argv[1:]
    trainer = Trainer(load_experiment_config(overrides))
    trainer.train_step(next(trainer.train_batches))  # warm-up: lazy state, first-step set-up
    counter = CollectiveBytes()
    with counter:
        trainer.train_step(next(trainer.train_batches))
    if trainer.backend.rank == 0:
        with open(out, "w") as handle:
            json.dump({name: [counter.calls[name], counter.bytes[name]] for name in counter.calls}, handle)
    trainer.backend.close()


if __name__ == "__main__":
    main()
