"""Training tokens/s and MFU on one CUDA GPU: the trainer's own step against HF transformers, same model, same run.

    python benchmarks/gpu_train.py [--model llama3_1b] [--seq-len 2048] [--batch 4] [--steps 20] [--no-compile]

axtorch's side is ``Trainer.train_step``, the step ``axtorch-train`` runs, with the trainer's own
settings for the device: ``trainer.precision=bf16`` (float32 master weights, bf16 autocast),
``trainer.compile`` (each decoder layer compiled), fused AdamW, gradient clipping and its default
loss (the head fused with the cross-entropy), reading the step's loss and norm as the trainer
does. HF's ``LlamaForCausalLM`` is built from the same config (the Llama family adapter,
``interop.families.llama``) with the same weights, and runs forward, its loss, backward, clipping
and a fused AdamW update, compiled whole with ``torch.compile``. MFU is model FLOPs (6N plus
attention, PaLM appendix B) per second over the chip's datasheet bf16 dense peak
(``axtorch.train.peak_flops``).

``--device cpu`` runs the same code on the CPU (against the measured fp32 GEMM peak, without
autocast), which is how the test suite checks that the script works on a machine with no GPU.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import transformers

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.interop.families.llama import LLAMA
from axtorch.interop.families.llama_layout import axtorch_to_hf_state_dict
from axtorch.models import CausalLMInput
from axtorch.train.flops import (
    active_non_embedding_parameters,
    measure_matmul_peak_flops,
    mfu,
    transformer_flops_per_token,
)
from axtorch.train.peak_flops import datasheet_peak_flops
from axtorch.train.trainer import Trainer

Step = Callable[[torch.Tensor], None]


def build_trainer(model_name: str, device: torch.device, args: argparse.Namespace, run_dir: str) -> Trainer:
    """The trainer a user's ``axtorch-train model=... trainer.device=...`` builds, on a small corpus."""
    bf16 = device.type == "cuda"
    overrides = [
        "experiment=debug",  # its small corpus: the batches below are random tokens anyway
        f"model={model_name}",
        f"run_dir={run_dir}",
        f"data.cache_dir={run_dir}/data",
        f"data.seq_len={args.seq_len}",
        f"trainer.batch_size={args.batch}",
        f"trainer.device={device}",
        f"trainer.precision={'bf16' if bf16 else 'fp32'}",
        f"trainer.compile={str(not args.no_compile).lower()}",
        *("trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.plot=false"),
    ]
    return Trainer(load_experiment_config(overrides))


def build_hf(ours: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """HF's model with ``ours``' weights, in float32 on ``device``."""
    config = ours.config
    hf_config = transformers.LlamaConfig(**LLAMA.config_to_hf(config))
    hf_config._attn_implementation = "sdpa"
    # Built on the device, not on meta: HF computes its RoPE ``inv_freq`` (a non-persistent buffer,
    # absent from any state dict) at construction, and ``to_empty`` would leave it uninitialised.
    with torch.device(device):
        theirs = transformers.LlamaForCausalLM(hf_config)
    loaded = theirs.load_state_dict(axtorch_to_hf_state_dict(ours.state_dict()), strict=False)
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    if set(loaded.missing_keys) != tied or loaded.unexpected_keys:
        raise RuntimeError(f"HF model does not match axtorch's: {loaded}")
    theirs.tie_weights()
    return theirs


def logits_difference(ours: torch.nn.Module, theirs: torch.nn.Module, vocab: int, device: torch.device) -> float:
    """max |logits difference| / max |logits| of the two models on one random batch, in float32:
    the peers must compute the same function before their speeds can be compared."""
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    # Eagerly: a compiled layer would compile an inference graph for this one batch.
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        ours_logits = ours(CausalLMInput(input_ids=tokens)).logits.float()
        theirs_logits = theirs(input_ids=tokens).logits.float()
    return ((ours_logits - theirs_logits).abs().max() / ours_logits.abs().max()).item()


def hf_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, autocast: bool) -> Step:
    """Forward, HF's own loss (it shifts the labels itself), backward, clipping and the update."""

    def step(tokens: torch.Tensor) -> None:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def trainer_step(trainer: Trainer) -> Step:
    """``Trainer.train_step`` on one batch: everything ``axtorch-train`` does in a step."""

    def step(tokens: torch.Tensor) -> None:
        trainer.train_step({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})

    return step


def timed(step: Step, batches: list[torch.Tensor]) -> float:
    device = batches[0].device
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for tokens in batches:
        step(tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_1b", help="an axtorch model preset (conf/model)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: this benchmark needs a GPU (--device cpu only checks that it runs)")
    autocast = device.type == "cuda"
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(args.model, device, args, run_dir)
        ours = trainer.model
        theirs = build_hf(ours, device)
        difference = logits_difference(ours, theirs, ours.config.vocab_size, device)
        if difference > 1e-4:
            raise SystemExit(f"the two models compute different logits (relative difference {difference:.2e})")
        optimizer = torch.optim.AdamW(theirs.parameters(), lr=1e-4, fused=device.type == "cuda")
        hf_model = theirs if args.no_compile else torch.compile(theirs)
        runs = {"axtorch": trainer_step(trainer), "hf_transformers": hf_step(hf_model, optimizer, autocast)}
        seconds = time_runs(runs, ours.config.vocab_size, device, args)
    report(args, ours, seconds, autocast, difference, device)


def time_runs(
    runs: dict[str, Step], vocab: int, device: torch.device, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Each run's seconds for ``args.steps`` steps, ``args.repeats`` times, in alternating order after a warm-up."""
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=generator).to(device)
        for _ in range(args.steps)
    ]
    for step in runs.values():  # warm-up and compilation
        timed(step, batches[:3])
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for _ in range(args.repeats):
        for name in order:
            seconds[name].append(timed(runs[name], batches))
        order.reverse()
    return seconds


def report(
    args: argparse.Namespace,
    ours: torch.nn.Module,
    seconds: dict[str, list[float]],
    autocast: bool,
    difference: float,
    device: torch.device,
) -> None:
    config = ours.config
    vocab = config.vocab_size
    flops_per_token = transformer_flops_per_token(
        active_non_embedding_parameters(ours),
        config.decoder.num_layers,
        config.dim,
        args.seq_len,
        vocab,
        config.tie_embeddings,
    )
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = datasheet_peak_flops(name, torch.bfloat16)
        if peak is None:
            raise SystemExit(f"{name!r} is not in axtorch.train.peak_flops: no datasheet peak to state MFU against")
        measured = measure_matmul_peak_flops(device, torch.bfloat16, size=8192, seconds=1.0)
        peak_source = (
            f"{name} datasheet bf16 dense peak {peak / 1e12:.0f} TFLOP/s "
            f"(this card's bf16 8192-matmul, measured now: {measured / 1e12:.0f} TFLOP/s)"
        )
    else:
        peak = measure_matmul_peak_flops(device)
        peak_source = f"measured fp32 GEMM peak {peak / 1e9:.1f} GFLOP/s"
    print(
        f"{args.model}: seq {args.seq_len}, batch {args.batch}, {'bf16 autocast' if autocast else 'fp32'}, "
        f"{'eager' if args.no_compile else 'compiled'}, fused AdamW, clipping; torch {torch.__version__}, "
        f"transformers {transformers.__version__}; MFU against the {peak_source}"
    )
    print(f"same function: max |logits difference| / max |logits| = {difference:.1e}")
    print("| implementation | tokens/s | MFU | step (s) |")
    print("|---|---|---|---|")
    tokens_per_run = args.steps * args.batch * args.seq_len
    throughput = {name: tokens_per_run / statistics.median(s) for name, s in seconds.items()}
    for name, value in throughput.items():
        step_seconds = statistics.median(seconds[name]) / args.steps
        print(f"| {name} | {value:.0f} | {mfu(value, flops_per_token, peak):.1%} | {step_seconds:.3f} |")
    print(f"ratio axtorch / hf_transformers: {throughput['axtorch'] / throughput['hf_transformers']:.3f}x")


if __name__ == "__main__":
    main()
