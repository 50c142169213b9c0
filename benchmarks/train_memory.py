"""Peak host memory of a training step at Llama 3's vocabulary (128256), axtorch against HF transformers.

    .venv/bin/python benchmarks/train_memory.py [--seq-lens 256 512 1024 2048] [--batch 1]

A small Llama (width 256, 4 layers, 4 heads / 2 KV heads, SwiGLU 768, untied head) has most of
its memory in the vocabulary: the embedding and head tables, and the [tokens, vocab] logits with
their gradient. Each measurement runs in a fresh process: it builds the model (the same weights
for both) and an AdamW optimizer, notes its resident set, runs two training steps (forward,
cross-entropy, backward, update), and reports the peak resident set above that baseline. So the
number is the step's own memory: activations, logits, gradients and optimizer state, not the
weights. "axtorch" is the default loss (the head fused with the cross-entropy in chunks of
``loss.chunk_size`` tokens); "whole logits" sets ``loss.chunk_size=null``. Linux's
``ru_maxrss`` is the measure (this machine has no GPU); the ratio, not the
absolute figure, is the comparison.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

CONFIG = dict(
    vocab_size=128256,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=768,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def measure(implementation: str, seq_len: int, batch: int) -> dict[str, float]:
    """Runs in the child process: the step's peak memory above the built model, in MiB."""
    import time

    import torch
    import transformers

    from axtorch.interop.families import config_from_hf
    from axtorch.interop.families.llama_layout import hf_to_axtorch_state_dict
    from axtorch.train.loss import CrossEntropyLossConfig, forward_with_loss

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(**CONFIG)
    hf_config._attn_implementation = "sdpa"
    hf_model = transformers.LlamaForCausalLM(hf_config)
    tokens = torch.randint(0, CONFIG["vocab_size"], (batch, seq_len + 1))
    if implementation.startswith("axtorch"):
        model = config_from_hf(hf_config).build()
        model.load_state_dict(hf_to_axtorch_state_dict(hf_model.state_dict(), tie_embeddings=False))
        del hf_model
        # "axtorch": the default loss, the head fused with the cross-entropy in chunks of tokens;
        # "axtorch-whole": loss.chunk_size=null, whole [tokens, vocab] logits as HF computes them.
        loss_fn = CrossEntropyLossConfig(**({"chunk_size": None} if implementation == "axtorch-whole" else {})).build()

        def step() -> torch.Tensor:
            return forward_with_loss(model, loss_fn, tokens[:, :-1], tokens[:, 1:])[0].loss

    else:
        model = hf_model

        def step() -> torch.Tensor:
            return model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    baseline = _rss_mib()
    started = time.perf_counter()
    for _ in range(2):
        step().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = (time.perf_counter() - started) / 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    return {"peak_mib": peak - baseline, "tokens_per_s": batch * seq_len / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        implementation, seq_len, batch = args.child
        print(json.dumps(measure(implementation, int(seq_len), int(batch))))
        return
    print(
        f"Llama, vocab {CONFIG['vocab_size']}, width {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers, "
        f"batch {args.batch}, fp32, AdamW; peak resident memory of a training step above the built model"
    )
    names = ("axtorch", "axtorch-whole", "hf")
    print("| seq | axtorch MiB | whole logits MiB | HF MiB | axtorch / HF | axtorch tok/s | whole tok/s | HF tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for seq_len in args.seq_lens:
        results = {}
        for implementation in names:
            command = [sys.executable, __file__, "--child", implementation, str(seq_len), str(args.batch)]
            output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            results[implementation] = json.loads(output.strip().splitlines()[-1])
        ours, whole, theirs = (results[name] for name in names)
        print(
            f"| {seq_len} | {ours['peak_mib']:.0f} | {whole['peak_mib']:.0f} | {theirs['peak_mib']:.0f} | "
            f"{ours['peak_mib'] / theirs['peak_mib']:.2f}x | {ours['tokens_per_s']:.0f} | "
            f"{whole['tokens_per_s']:.0f} | {theirs['tokens_per_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
