"""Run under torchrun by the dry run's reality check: real training steps measured with the dry
run's own tools (``axtorch.train.dry_run.measured_run``).

    torchrun --nproc-per-node N tests/parallel/dry_run_worker.py OUT OVERRIDE...

Rank 0 writes OUT (JSON): memory at the peak by kind, collectives per step (kind, count, bytes),
FLOPs per step.
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
    report = measured_run(config, mesh)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(dataclasses.asdict(report)))
    exit_process(0, skip_finalization=True)


if __name__ == "__main__":
    main()
