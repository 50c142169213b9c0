"""The planner's per-device memory against the dry run's, for the same model, mesh and batch.

    .venv/bin/python benchmarks/dry_run_vs_plan.py [--rows 8b 70b gemma3] [--steps 1]

``axtorch-plan`` prices a formula of the model (``axtorch.plan.memory``); the dry run
(``axtorch-train dry_run=true``, ``axtorch.train.dry_run``) traces the real training step on fake
tensors and a fake process group, and measures what is live at its peak. Each row runs both on
one experiment and prints the two peaks side by side, by kind, with their ratio (with pipeline
stages, the dry run's fullest stage's first rank, as the planner's figure is for the fullest).
The machine's speed does not enter: both are counts of bytes, and the seconds each took are
printed only to say what the row costs.
"""

from __future__ import annotations

import argparse
import time

from axtorch.config.errors import ConfigError
from axtorch.parallel.chips import GIB
from axtorch.plan import load_plan_inputs
from axtorch.plan.check import by_kind, planned_by_kind
from axtorch.plan.placement import plan
from axtorch.train.dry_run import dry_run

#: name -> the overrides of one row (a model, its mesh, the batch and sequence it trains with).
ROWS = {
    "8b": [
        "model=llama3_8b",
        "backend=native",
        "mesh.fsdp=64",
        "sharding=fsdp",
        "trainer.batch_size=64",
        "data.seq_len=4096",
    ],
    "70b": [
        "model=llama3_70b",
        "backend=native",
        "mesh.fsdp=32",
        "mesh.model=8",
        "sharding=fsdp_tp",
        "trainer.batch_size=32",
        "data.seq_len=4096",
    ],
    "405b": [
        "model=llama3_405b",
        "backend=native",
        "mesh.pipe=8",
        "mesh.fsdp=16",
        "mesh.model=8",
        "sharding=fsdp_tp",
        "trainer.batch_size=128",
        "pipeline.microbatches=8",
        "data.seq_len=4096",
    ],
    "mixtral": [
        "model=mixtral_8x7b",
        "backend=native",
        "mesh.expert=8",
        "mesh.fsdp=8",
        "sharding=fsdp_ep",
        "trainer.batch_size=64",
        "data.seq_len=4096",
    ],
    "qwen3_moe": [
        "model=qwen3_30b_a3b",
        "backend=native",
        "mesh.fsdp=32",
        "sharding=fsdp",
        "trainer.batch_size=32",
        "data.seq_len=4096",
    ],
    "gemma3": ["model=gemma3_270m", "backend=native", "trainer.batch_size=8", "data.seq_len=1024"],
}


def compare(name: str, steps: int) -> str:
    """One row of the table: the planner's figures, the dry run's, their ratio, or why there is none."""
    config, mesh = load_plan_inputs(ROWS[name])
    # The planner's batch is per device and micro-batch: a replica's rows over the pipeline's micro-batches.
    replicas = mesh["data"] * mesh["fsdp"] * mesh["seq"] * mesh["expert"]
    rows_per_device = config.trainer.batch_size // replicas // config.pipeline.planned_microbatches(mesh["pipe"])
    planned = plan(config, mesh, batch_size=rows_per_device).memory
    split = " ".join(f"{axis}={size}" for axis, size in mesh.items() if size != 1) or "1 device"
    started = time.perf_counter()
    try:
        report = dry_run(config, mesh, steps)
    except ConfigError as error:
        why = f"not traced yet ({error.key}={error.value}: docs/parallelism.md)"
        return f"| {name} | {split} | {planned.total_bytes / GIB:.2f} | {why} | | | |"
    dry, planner = by_kind(report), planned_by_kind(planned)
    ratio = planned.total_bytes / report.peak_bytes
    took = time.perf_counter() - started
    return (
        f"| {name} | {split} | {_gib(planned.total_bytes, planner)} | {_gib(report.peak_bytes, dry)} "
        f"| {ratio:.2f} | {took:.0f} s |"
    )


def _gib(total: int, parts: dict[str, int]) -> str:
    return f"{total / GIB:.2f} (" + ", ".join(f"{kind} {value / GIB:.2f}" for kind, value in parts.items()) + ")"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--steps", type=int, default=1, help="steps traced, the optimizer state made first")
    args = parser.parse_args()
    print(
        "| row | mesh | planner GiB/device | dry run GiB/device (rank 0, its peak) | planner / dry run | dry run took |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.rows:
        print(compare(name, args.steps), flush=True)


if __name__ == "__main__":
    main()
