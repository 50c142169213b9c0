"""Three views of one step's memory per chip: the planner, the native dry run and the TPU compiler.

    .venv-xla/bin/python benchmarks/tpu_compile.py [--rows 1b 8b gemma3 moe 8b_fsdp64 70b] [--compile-effort -1]

For each row (a model, a TPU slice, its mesh and batch) it prints, per device:

- the planner's formula for the xla backend (``axtorch.plan``: parameters, gradients, AdamW state,
  activations, and every weight held gathered over fsdp, as the TPU compiler holds them);
- the native dry run's peak (``axtorch.train.dry_run``: the native backend's step traced on fake
  tensors over a fake process group of the slice's size: FSDP2's gathers and buffers, not XLA's);
- the TPU compiler's (``dry_run=true backend=xla hardware=<slice>``): the xla backend's own step
  compiled for the slice by libtpu, its arguments, temporaries and code, as the TPU would hold them.

Each view runs in its own process, in the environment of the ``tpu`` extra (``.venv-xla``). The
machine's speed does not enter the figures (byte counts); the seconds each took are printed to say
what a row costs (the compile dominates: minutes, and most of this machine's 24 GiB, for 8B).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from axtorch.parallel.chips import GIB

#: name -> (the slice, the overrides of one row: a model, its mesh, the batch and sequence).
ROWS = {
    "1b": (
        "tpu-v5p-16",
        ["model=llama3_1b", "mesh.fsdp=8", "sharding=fsdp", "trainer.batch_size=8", "data.seq_len=2048"],
    ),
    "gemma3": ("tpu-v5e-16", ["model=gemma3_270m", "mesh.fsdp=16", "sharding=fsdp", "trainer.batch_size=16"]),
    "moe": (
        "tpu-v5p-16",
        [
            "model=mixtral_8x7b",
            "model.decoder.num_layers=2",
            "mesh.expert=8",
            "sharding=fsdp_ep",
            "trainer.batch_size=8",
        ],
    ),
    "8b": (
        "tpu-v5p-128",
        ["model=llama3_8b", "mesh.fsdp=8", "mesh.model=8", "sharding=fsdp_tp", "trainer.batch_size=8"],
    ),
    # Unrolled over fsdp alone, 8B's compile needs more of the host's memory than this 24 GiB
    # machine has at the compiler's default effort, 20 GB at --compile-effort -1
    # (docs/parallelism.md, "The TPU compiler's view").
    "8b_fsdp64": ("tpu-v5p-128", ["model=llama3_8b", "mesh.fsdp=64", "sharding=fsdp", "trainer.batch_size=64"]),
    "70b": (
        "tpu-v5p-512",
        ["model=llama3_70b", "mesh.fsdp=32", "mesh.model=8", "sharding=fsdp_tp", "trainer.batch_size=32"],
    ),
}
#: What runs without --rows: the rows that compile on a 2-core, 24 GiB host (about 15 minutes).
DEFAULT_ROWS = ["1b", "8b", "gemma3", "moe", "70b"]

VIEWS = """
import json, sys
from axtorch.compose.registry import register_configs
from axtorch.plan import load_plan_inputs
register_configs()
view, hardware, effort, overrides = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4:]
if view == "planner":
    from axtorch.plan.placement import plan
    config, mesh = load_plan_inputs([*overrides, "backend=xla"])
    rows = config.trainer.batch_size // (mesh["data"] * mesh["fsdp"] * mesh["seq"] * mesh["expert"])
    print(json.dumps({"bytes": plan(config, mesh, batch_size=max(rows, 1)).memory.total_bytes}))
elif view == "native":
    from axtorch.train.dry_run import dry_run
    config, mesh = load_plan_inputs([*overrides, "backend=native"])
    print(json.dumps({"bytes": dry_run(config, mesh).peak_bytes}))
else:
    from axtorch.parallel.chips import tpu_topology
    from axtorch.train.xla_dry_run import xla_dry_run
    config, mesh = load_plan_inputs([*overrides, "backend=xla"])
    compiled = xla_dry_run(config, mesh, tpu_topology(hardware), effort).compiled
    print(json.dumps({"bytes": compiled.hbm_bytes, "temporary": compiled.temporary_bytes,
                      "arguments": compiled.argument_bytes, "seconds": compiled.compile_seconds}))
"""


def measure(view: str, hardware: str, effort: float, overrides: list[str]) -> tuple[dict, float]:
    env = {key: value for key, value in os.environ.items() if key not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", VIEWS, view, hardware, str(effort), *overrides],
        capture_output=True,
        text=True,
        env=env | {"TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    took = time.perf_counter() - started
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["killed"])[-1][:160]}, took
    return json.loads(result.stdout.strip().splitlines()[-1]), took


def row(name: str, effort: float) -> str:
    """One row of the table: each view's bytes per device, their ratios to the compiler's, the seconds."""
    hardware, overrides = ROWS[name]
    figures = {view: measure(view, hardware, effort, overrides) for view in ("planner", "native", "compiler")}
    values = {view: figure.get("bytes") for view, (figure, _) in figures.items()}
    shown = {
        view: f"{figure['bytes'] / GIB:.2f}" if "bytes" in figure else figure["error"]
        for view, (figure, _) in figures.items()
    }
    compiled, _ = figures["compiler"]
    if "temporary" in compiled:
        shown["compiler"] += f" ({compiled['temporary'] / GIB:.2f})"
    ratios = {
        view: "-" if values[view] is None or values["compiler"] is None else f"{values[view] / values['compiler']:.2f}"
        for view in ("planner", "native")
    }
    took = ", ".join(f"{seconds:.0f} s" for _, seconds in figures.values())
    return (
        f"| {name} | {hardware} | {' '.join(overrides)} | {shown['planner']} | {shown['native']} | {shown['compiler']} "
        f"| {ratios['planner']} | {ratios['native']} | {took} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=DEFAULT_ROWS)
    parser.add_argument(
        "--compile-effort", type=float, default=0.0, help="the TPU compiler's optimization effort, -1 to 1 (0: a TPU's)"
    )
    args = parser.parse_args()
    print(
        "| row | slice | overrides | planner GiB | native dry run GiB | TPU compiler GiB (temporaries) "
        "| planner / compiler | native / compiler | took (plan, native, compile) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.rows:
        print(row(name, args.compile_effort), flush=True)


if __name__ == "__main__":
    main()
