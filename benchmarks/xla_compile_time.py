"""XLA compile time against depth, unrolled and scanned (``execution.layer_runner``), from the goodput record.

    .venv/bin/python benchmarks/xla_compile_time.py [--layers 2 8 32] [--devices 4]

Each configuration trains 3 steps of ``llama_debug`` (width 64, 4 heads) with ``backend=xla``
(fsdp over ``--devices`` CPU virtual devices) in a fresh process of the torch_xla environment
(``.venv-xla``, or ``$AXTORCH_XLA_PYTHON``), so nothing is cached between runs. The compile time
is the goodput record's ``compile``: the first training step's excess over the second (tracing,
XLA compilation and warm-up of the forward, backward and optimizer graph). The table also gives
that first step's ratio to the shallowest model's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compile_seconds(python: Path, layers: int, scan: bool, devices: int, run_dir: Path) -> float:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "TF_CPP_MIN_LOG_LEVEL": "2"}
    overrides = [
        "experiment=debug",
        "backend=xla",
        f"mesh.fsdp={devices}",
        "sharding=fsdp",
        f"model.decoder.num_layers={layers}",
        f"execution.layer_runner={'scan' if scan else 'unrolled'}",
        "trainer.max_steps=3",
        "trainer.eval_every=1000",
        "trainer.checkpoint_every=1000",
        "trainer.log_every=1",
        "trainer.progress_bar=false",
        "trainer.plot=false",
        "trainer.tensorboard=false",
        f"run_dir={run_dir}",
        f"data.cache_dir={run_dir.parent / 'cache'}",
    ]
    result = subprocess.run(
        [str(python), "-m", "axtorch.train", *overrides], env=env, cwd=ROOT, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(f"{layers} layers, scan={scan}: exit {result.returncode}\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "goodput.jsonl").read_text().splitlines()]
    return float(records[-1]["seconds"]["compile"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--devices", type=int, default=4)
    args = parser.parse_args()
    python = Path(os.environ.get("AXTORCH_XLA_PYTHON", ROOT / ".venv-xla" / "bin" / "python"))
    if not python.exists():
        raise SystemExit(f"no torch_xla environment at {python} (make test creates .venv-xla)")
    seconds: dict[tuple[int, bool], float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for scan in (False, True):
            for layers in args.layers:
                run_dir = Path(scratch) / f"layers{layers}_scan{scan}"
                seconds[layers, scan] = compile_seconds(python, layers, scan, args.devices, run_dir)
    print(f"llama_debug, backend=xla, fsdp={args.devices} CPU devices, compile time of the training step (s)")
    print("| layers | unrolled | vs shallowest | layer_runner=scan | vs shallowest |")
    print("|---|---|---|---|---|")
    shallowest = min(args.layers)
    for layers in args.layers:
        unrolled, scanned = seconds[layers, False], seconds[layers, True]
        print(
            f"| {layers} | {unrolled:.1f} | {unrolled / seconds[shallowest, False]:.2f}x | "
            f"{scanned:.1f} | {scanned / seconds[shallowest, True]:.2f}x |"
        )


if __name__ == "__main__":
    main()
