"""What verification costs a checkpoint save: hashing and fsync against writing the files, same run.

    .venv/bin/python benchmarks/checkpoint_cost.py [--model llama_bench] [--repeats 3]

Saves the model and its AdamW state (moments filled by one step) with ``Checkpointer`` and
reports, per save, the whole save and the parts spent on fsync and on the XXH3-128 digests of the
manifest. The digest was SHA-256 until this benchmark showed it cost about a fifth of a save.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from axtorch.compose import load_experiment_config
from axtorch.train import checkpoint_manifest
from axtorch.train.checkpoint import Checkpointer
from axtorch.train.optimizer import build_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_bench")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = load_experiment_config([f"model={args.model}"])
    model = config.model.build()
    model.init_weights()
    optimizer = build_optimizer(model, config.optim)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()

    spent = {"fsync": 0.0, "digest": 0.0}

    def timed(part: str, function):
        def run(*args):
            start = time.perf_counter()
            result = function(*args)
            spent[part] += time.perf_counter() - start
            return result

        return run

    checkpoint_manifest.fsync_file = timed("fsync", checkpoint_manifest.fsync_file)
    checkpoint_manifest.file_record = timed("digest", checkpoint_manifest.file_record)
    totals = []
    with tempfile.TemporaryDirectory() as root:
        checkpointer = Checkpointer(Path(root), keep=1)
        for step in range(args.repeats):
            start = time.perf_counter()
            path = checkpointer.save(step, model, optimizer, {"step": step})
            totals.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    total = statistics.median(totals)
    fsync, digest = spent["fsync"] / args.repeats, spent["digest"] / args.repeats
    parameters = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model={args.model}: {parameters:.1f}M parameters, {size:.0f} MiB a save")
    print("| save (median) | fsync (mean) | XXH3-128 digest (mean) | the rest | digest share |")
    print("|---|---|---|---|---|")
    rest = total - fsync - digest
    print(f"| {total:.3f} s | {fsync:.3f} s | {digest:.3f} s | {rest:.3f} s | {digest / total:.1%} |")


if __name__ == "__main__":
    main()
