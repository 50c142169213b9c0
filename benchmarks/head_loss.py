"""The fused head and cross-entropy, eager against compiled chunks: what ``trainer.compile`` decides per device.

    python benchmarks/head_loss.py [--device cuda] [--tokens 8192] [--vocab 128256] [--dim 2048] [--repeats 3]

Times ``head_cross_entropy`` (forward with the gradients of the hidden states and the head, at the
default ``loss.chunk_size``) with each chunk's softmax and gradient eager, then compiled, in
alternating runs, with the device's measured GEMM peak beside each pair. On CUDA it runs in bf16
autocast, as ``trainer.precision=bf16`` does; on the CPU in float32.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from axtorch.train.flops import measure_matmul_peak_flops
from axtorch.train.head_cross_entropy import head_cross_entropy
from axtorch.train.loss import CrossEntropyLossConfig


def time_head(compiled: bool, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, steps: int) -> float:
    """Seconds a call: the fused forward, which computes the gradients too, then their backward."""
    autocast = torch.autocast("cuda", torch.bfloat16) if hidden.is_cuda else contextlib.nullcontext()
    chunk_size = CrossEntropyLossConfig().chunk_size
    normalizer = torch.tensor(labels.numel(), device=hidden.device)

    def call() -> None:
        with autocast:
            loss, _, _ = head_cross_entropy(
                hidden, weight, None, labels, ignore_index=-100, z_loss_weight=0.0,
                normalizer=normalizer, chunk_size=chunk_size, compiled=compiled,
            )  # fmt: skip
        loss.backward()

    def sync() -> None:
        if hidden.is_cuda:
            torch.cuda.synchronize()

    for _ in range(2):  # the compile, and a warm call
        call()
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        call()
    sync()
    return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192, help="a step's tokens (4 x 2048: one_gpu.sh's step)")
    parser.add_argument("--vocab", type=int, default=128256, help="Llama 3's")
    parser.add_argument("--dim", type=int, default=2048, help="llama3_1b's")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    hidden = torch.randn(1, args.tokens, args.dim, device=device, requires_grad=True)
    weight = (torch.randn(args.vocab, args.dim, device=device) * 0.02).requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens), device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"head {args.vocab} x {args.dim}, {args.tokens} tokens, chunks of {CrossEntropyLossConfig().chunk_size}")
    print("| run | GEMM peak measured beside it | eager ms | compiled ms | compiled / eager |")
    print("|---|---|---|---|---|")
    for run in range(1, args.repeats + 1):
        peak = measure_matmul_peak_flops(device, dtype)
        eager = time_head(False, hidden, weight, labels, args.steps)
        compiled = time_head(True, hidden, weight, labels, args.steps)
        print(
            f"| {run} | {peak / 1e9:,.0f} GFLOP/s | {eager * 1e3:.3f} | {compiled * 1e3:.3f} | {compiled / eager:.2f} |"
        )


if __name__ == "__main__":
    main()
