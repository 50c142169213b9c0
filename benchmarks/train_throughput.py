"""Training throughput of axtorch against HF transformers' LlamaForCausalLM, same shape, same machine.

    .venv/bin/python benchmarks/train_throughput.py [--steps 10] [--repeats 3] [--compile]

Both models take identical weights and batches; a step is forward, loss, backward and an AdamW
update. Runs alternate between the two models so that machine drift affects both alike; the table
reports the median of ``--repeats`` timed runs. MFU is against the fp32 GEMM peak measured here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from axtorch.interop.families import config_from_hf
from axtorch.interop.families.llama_layout import hf_to_axtorch_state_dict
from axtorch.train.flops import measure_matmul_peak_flops, mfu, transformer_flops_per_token
from axtorch.train.loss import CrossEntropyLossConfig, forward_with_loss

REFERENCE = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1536,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
SEQ_LEN, BATCH = 256, 8


def build_models():
    hf_config = transformers.LlamaConfig(**REFERENCE)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_config)
    ours = config_from_hf(hf_config).build()
    ours.load_state_dict(hf_to_axtorch_state_dict(hf_model.state_dict(), tie_embeddings=False))
    return hf_model, ours


def hf_step(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def make_axtorch_step():
    loss_fn = CrossEntropyLossConfig().build()

    def step(model, batch):  # as the trainer runs it: the head fused with the loss (loss.chunk_size)
        return forward_with_loss(model, loss_fn, batch["input_ids"], batch["labels"])[0].loss

    return step


def time_steps(model, step_fn, batches, optimizer) -> float:
    started = time.perf_counter()
    for batch in batches:
        step_fn(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    args = parser.parse_args()

    hf_model, ours = build_models()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, REFERENCE["vocab_size"], (args.steps, BATCH, SEQ_LEN + 1), generator=generator)
    hf_batches = [{"input_ids": t[:, :-1], "labels": t[:, :-1]} for t in tokens]  # HF shifts labels itself
    our_batches = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
    runs = {
        "axtorch": (ours, make_axtorch_step(), our_batches),
        "hf_transformers": (hf_model, hf_step, hf_batches),
    }
    optimizers = {
        name: torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True) for name, (model, _, _) in runs.items()
    }
    if args.compile:
        runs = {name: (torch.compile(model), fn, b) for name, (model, fn, b) in runs.items()}

    for name, (model, fn, batches) in runs.items():  # warm-up (and compilation)
        time_steps(model, fn, batches[:2], optimizers[name])
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for _ in range(args.repeats):
        for name in order:
            model, fn, batches = runs[name]
            seconds[name].append(time_steps(model, fn, batches, optimizers[name]))
        order.reverse()  # neither model always runs first

    peak = measure_matmul_peak_flops(torch.device("cpu"))
    non_embedding = sum(p.numel() for n, p in ours.named_parameters() if n != "embedding.weight")
    flops_per_token = transformer_flops_per_token(
        non_embedding, REFERENCE["num_hidden_layers"], REFERENCE["hidden_size"], SEQ_LEN, REFERENCE["vocab_size"], False
    )
    tokens_per_run = args.steps * BATCH * SEQ_LEN
    throughput = {name: tokens_per_run / statistics.median(s) for name, s in seconds.items()}
    print(
        f"shape: vocab {REFERENCE['vocab_size']}, width {REFERENCE['hidden_size']}, "
        f"{REFERENCE['num_hidden_layers']} layers, {REFERENCE['num_attention_heads']} heads / "
        f"{REFERENCE['num_key_value_heads']} kv, FFN {REFERENCE['intermediate_size']} SwiGLU, seq {SEQ_LEN}, "
        f"batch {BATCH}, fp32, AdamW; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} threads{', compiled' if args.compile else ''}"
    )
    print(f"measured fp32 GEMM peak: {peak / 1e9:.1f} GFLOP/s; model FLOPs/token: {flops_per_token / 1e6:.1f} M")
    print(f"{'implementation':<18}{'tokens/s':>12}{'MFU':>9}{'step (s)':>11}")
    for name, value in throughput.items():
        step_seconds = statistics.median(seconds[name]) / args.steps
        print(f"{name:<18}{value:>12.0f}{mfu(value, flops_per_token, peak):>9.1%}{step_seconds:>11.3f}")
    print(f"ratio axtorch / hf_transformers: {throughput['axtorch'] / throughput['hf_transformers']:.3f}x")


if __name__ == "__main__":
    main()
