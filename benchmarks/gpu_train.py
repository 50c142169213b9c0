"""Training tokens/s and MFU on one CUDA GPU: axtorch against HF transformers, same model, same run.

    python benchmarks/gpu_train.py [--model llama3_1b] [--seq-len 2048] [--batch 4] [--steps 20] [--no-compile]

The model is an axtorch preset (``conf/model``); HF's ``LlamaForCausalLM`` is built from the
same config (the Llama family adapter, ``interop.families.llama``) with the same weights. Each
step is forward, loss, backward and a fused AdamW update, with float32 master weights and bf16
autocast, both models compiled with ``torch.compile``. axtorch runs its default loss (the head
fused with the cross-entropy, ``loss.chunk_size``); HF runs its own. MFU is model FLOPs (6N plus
attention, PaLM appendix B) per second over the chip's datasheet bf16 dense peak
(``axtorch.train.peak_flops``).

``--device cpu`` runs the same code on the CPU (against the measured fp32 GEMM peak, without
autocast), which is how the test suite checks that the script works on a machine with no GPU.
"""

from __future__ import annotations

import argparse
import statistics
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
from axtorch.train.loss import CrossEntropyLossConfig, forward_with_loss
from axtorch.train.peak_flops import datasheet_peak_flops

Step = Callable[[torch.Tensor], torch.Tensor]


def build(model_name: str, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """axtorch's model and HF's, with the same weights, in float32 on ``device``."""
    config = load_experiment_config([f"model={model_name}"]).model
    torch.manual_seed(0)
    with torch.device("meta"):
        ours = config.build()
    ours.to_empty(device=device)
    ours.init_weights()
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
    return ours, theirs


def logits_difference(ours: torch.nn.Module, theirs: torch.nn.Module, vocab: int, device: torch.device) -> float:
    """max |logits difference| / max |logits| of the two models on one random batch, in float32:
    the peers must compute the same function before their speeds can be compared."""
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        ours_logits = ours(CausalLMInput(input_ids=tokens)).logits.float()
        theirs_logits = theirs(input_ids=tokens).logits.float()
    return ((ours_logits - theirs_logits).abs().max() / ours_logits.abs().max()).item()


def steps(ours: torch.nn.Module, theirs: torch.nn.Module) -> dict[str, Step]:
    loss_fn = CrossEntropyLossConfig().build()
    return {
        "axtorch": lambda tokens: forward_with_loss(ours, loss_fn, tokens[:, :-1], tokens[:, 1:])[0].loss,
        # HF shifts the labels itself.
        "hf_transformers": lambda tokens: theirs(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss,
    }


def timed(step: Step, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor], autocast: bool) -> float:
    device = batches[0].device
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for tokens in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = step(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
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
    ours, theirs = build(args.model, device)
    difference = logits_difference(ours, theirs, ours.config.vocab_size, device)
    if difference > 1e-4:
        raise SystemExit(f"the two models compute different logits (relative difference {difference:.2e})")
    runs = steps(ours, theirs)
    models = {"axtorch": ours, "hf_transformers": theirs}
    fused = device.type == "cuda"
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused) for name, m in models.items()}
    if not args.no_compile:
        compiled = {name: torch.compile(m) for name, m in models.items()}
        runs = steps(compiled["axtorch"], compiled["hf_transformers"])
    vocab = ours.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=generator).to(device)
        for _ in range(args.steps)
    ]
    for name, step in runs.items():  # warm-up and compilation
        timed(step, optimizers[name], batches[:3], autocast)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for _ in range(args.repeats):
        for name in order:
            seconds[name].append(timed(runs[name], optimizers[name], batches, autocast))
        order.reverse()

    config = ours.config
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
        f"{'eager' if args.no_compile else 'compiled'}, AdamW; torch {torch.__version__}, "
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
