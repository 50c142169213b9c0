"""Run under torchrun by the dry run's reality check: real training steps measured with the dry
run's own tools (``axtorch.train.dry_run.measured_run``).

    torchrun --nproc-per-node N tests/parallel/dry_run_worker.py OUT OVERRIDE...

Rank 0 writes OUT (JSON): for every rank, in rank order, its memory at the peak by kind,
collectives per step (kind, count, bytes) and FLOPs per step.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist

from axtorch.parallel.shutdown import exit_process
from axtorch.plan import load_plan_inputs
from axtorch.train.dry_run import measured_run


def main() -> None:
    out, *overrides = sys.argv[1:]
    config, mesh = load_plan_inputs(overrides)
    (trace,) = measured_run(config, mesh).ranks
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, dataclasses.asdict(trace))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(every_rank))
    exit_process(0, skip_finalization=True)


if __name__ == "__main__":
    main()
