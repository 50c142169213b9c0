"""What checkpointing costs training: per step, synchronous and asynchronous, against none; and
what verification (fsync, digests) costs a save. All in the same run, on the same model.

    .venv/bin/python benchmarks/checkpoint_cost.py [--model llama_bench] [--steps 24] [--every 6] [--repeats 3]

The step table trains ``--steps`` AdamW steps (batch 8 x 256 tokens) three ways: never saving,
saving every ``--every`` steps synchronously, and saving asynchronously (``Checkpointer`` with
``async_save``, the trainer's default). Saves fall at steps ``every, 2 * every, ...`` before the
last step, as in a long run; the timed loop ends by waiting for a save still in flight, so none
is left unpaid. The three ways take turns within each repeat so that machine
drift affects them alike; the median repeat is reported. "stall" is the time the training thread
spent inside ``save`` (the host copy; for a synchronous save, everything).

The save table times one synchronous save of the model and its AdamW state, and the parts of it
spent on fsync and on the XXH3-128 digests of the manifest. The digest was SHA-256 until this
benchmark showed it cost about a fifth of a save.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

from axtorch.compose import load_experiment_config
from axtorch.models import CausalLMInput
from axtorch.train import checkpoint_manifest
from axtorch.train.checkpoint import Checkpointer
from axtorch.train.loss import LossInput
from axtorch.train.optimizer import build_optimizer

BATCH, SEQ_LEN = 8, 256
WAYS = ("none", "sync", "async")


def build(model_name: str):
    config = load_experiment_config([f"model={model_name}"])
    torch.manual_seed(0)
    model = config.model.build()
    model.init_weights()
    return config, model, build_optimizer(model, config.optim), config.loss.build()


def train(model, optimizer, loss_fn, tokens: torch.Tensor, every: int, checkpointer: Optional[Checkpointer]):
    """(seconds for the steps, the last save's wait included; seconds stalled inside ``save``)."""
    stalled = 0.0
    started = time.perf_counter()
    for step, rows in enumerate(tokens, start=1):
        logits = model(CausalLMInput(input_ids=rows[:, :-1])).logits
        loss_fn(LossInput(logits, rows[:, 1:])).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if checkpointer is not None and step % every == 0 and step < len(tokens):
            saving = time.perf_counter()
            checkpointer.save(step, model, optimizer, {"step": step})
            stalled += time.perf_counter() - saving
    if checkpointer is not None:
        waiting = time.perf_counter()
        checkpointer.wait()
        stalled += time.perf_counter() - waiting
    return time.perf_counter() - started, stalled


def step_cost(model_name: str, steps: int, every: int, repeats: int) -> None:
    config, model, optimizer, loss_fn = build(model_name)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.model.vocab_size, (steps, BATCH, SEQ_LEN + 1), generator=generator)
    train(model, optimizer, loss_fn, tokens[:2], every, None)  # warm-up
    seconds: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    order = list(WAYS)
    for _ in range(repeats):
        for way in order:
            with tempfile.TemporaryDirectory() as root:
                checkpointer = None if way == "none" else Checkpointer(Path(root), keep=2, async_save=way == "async")
                seconds[way].append(train(model, optimizer, loss_fn, tokens, every, checkpointer))
        order.reverse()
    print(f"\nstep cost: {steps} steps of batch {BATCH} x {SEQ_LEN} tokens, a save every {every} steps")
    print("| checkpointing | step (median) | overhead per step | stall per save |")
    print("|---|---|---|---|")
    baseline = statistics.median(total for total, _ in seconds["none"]) / steps
    for way in WAYS:
        total, stalled = sorted(seconds[way])[len(seconds[way]) // 2]
        step = total / steps
        stall = "-" if way == "none" else f"{stalled / ((steps - 1) // every):.3f} s"
        print(f"| {way} | {step:.3f} s | {(step - baseline) / baseline:+.1%} | {stall} |")


def save_breakdown(model_name: str, repeats: int) -> None:
    _, model, optimizer, _ = build(model_name)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    spent = {"fsync": 0.0, "digest": 0.0}

    def timed(part: str, function: Callable) -> Callable:
        def run(*args):
            start = time.perf_counter()
            result = function(*args)
            spent[part] += time.perf_counter() - start
            return result

        return run

    real = checkpoint_manifest.fsync_file, checkpoint_manifest.file_record
    checkpoint_manifest.fsync_file = timed("fsync", checkpoint_manifest.fsync_file)
    checkpoint_manifest.file_record = timed("digest", checkpoint_manifest.file_record)
    totals = []
    try:
        with tempfile.TemporaryDirectory() as root:
            checkpointer = Checkpointer(Path(root), keep=1)
            for step in range(repeats):
                start = time.perf_counter()
                path = checkpointer.save(step, model, optimizer, {"step": step})
                totals.append(time.perf_counter() - start)
            size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    finally:
        checkpoint_manifest.fsync_file, checkpoint_manifest.file_record = real
    total = statistics.median(totals)
    fsync, digest = spent["fsync"] / repeats, spent["digest"] / repeats
    print(f"\none synchronous save: {size:.0f} MiB (parameters and AdamW moments)")
    print("| save (median) | fsync (mean) | XXH3-128 digest (mean) | the rest | digest share |")
    print("|---|---|---|---|---|")
    rest = total - fsync - digest
    print(f"| {total:.3f} s | {fsync:.3f} s | {digest:.3f} s | {rest:.3f} s | {digest / total:.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama_bench")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    parameters = sum(p.numel() for p in build(args.model)[1].parameters()) / 1e6
    print(
        f"model={args.model}: {parameters:.1f}M parameters; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    step_cost(args.model, args.steps, args.every, args.repeats)
    save_breakdown(args.model, args.repeats)


if __name__ == "__main__":
    main()
