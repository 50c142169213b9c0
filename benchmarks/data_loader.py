"""What the data path costs: tokenizing a corpus into shards, reading batches from them, and streaming.

    .venv/bin/python benchmarks/data_loader.py [--sizes-mb 40 160] [--workers 2] [--batches 200]
        [--stream-sizes-mb 500 2000] [--stream-batches 2000] [--step-repeats 3]

For each size, synthesises a corpus of that many MB of text files (documents of 2-20 KB drawn
from the standard library's sources, repeated), runs ``axtorch-tokenize`` on it in a child
process and reports its tokens/s and the child's peak resident memory: memory that stays flat as
the corpus grows shows that tokenizing streams. Then it reads ``--batches`` training batches of
the reference shape (8 x 256 tokens, as ``train_throughput.py`` trains) from the largest
corpus's shards through ``DataModule``, and compares the loader's tokens/s with the training
step's, measured on the same machine by ``train_throughput.py`` (pass ``--step-tokens-per-s``).

Streaming (``data.source.streaming=true``): synthesises JSONL corpora of ``--stream-sizes-mb``
(the same documents as JSON lines) and, in a child process each, (a) reads every document of
rank 0 of 2 (virtual streams 0-3 of 8) through the per-rank reader, the way that rank's loader
reads them, and reports the child's peak resident memory: flat in the corpus size means nothing
proportional to it is held; (b) on the first corpus, times ``--stream-batches`` batches of the
reference shape from the streaming loader, tokenizing on the fly on one core (one torch thread, one
tokenizers thread, no worker process), against the training step of the reference model timed
in this same run (``train_throughput.py``'s axtorch step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from axtorch.compose import load_experiment_config
from axtorch.data.loader import build_data

BATCH, SEQ_LEN = 8, 256
STREAMS, RANKS = 8, 2


def documents(megabytes: int):
    """Documents of 2-20 KB totalling ``megabytes`` MB, cut from the standard library's sources."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = "\n".join(path.read_text(errors="replace") for path in sources)
    written = count = 0
    offset = 0
    while written < megabytes * 1_000_000:
        size = 2_000 + (count * 7919) % 18_000
        chunk = text[offset : offset + size] or text[:size]
        offset = (offset + size) % max(1, len(text) - size)
        yield chunk
        written += len(chunk.encode())
        count += 1


def synthesise(directory: Path, megabytes: int) -> int:
    """Text files of ``documents(megabytes)``, one a file; returns the file count."""
    directory.mkdir(parents=True)
    count = 0
    for count, chunk in enumerate(documents(megabytes), start=1):
        (directory / f"{count - 1:07d}.txt").write_text(chunk)
    return count


def synthesise_jsonl(directory: Path, megabytes: int, files: int = 4) -> int:
    """``documents(megabytes)`` as JSON lines, dealt over ``files`` files; returns the document count."""
    directory.mkdir(parents=True)
    outputs = [(directory / f"{index}.jsonl").open("w") for index in range(files)]
    count = 0
    for count, chunk in enumerate(documents(megabytes), start=1):
        outputs[count % files].write(json.dumps({"text": chunk}) + "\n")
    for output in outputs:
        output.close()
    return count


def tokenize(corpus: Path, out: Path, workers: int) -> tuple[float, int, float]:
    """(seconds, tokens, peak RSS MiB of the tokenizing process and its workers)."""
    command = [
        sys.executable,
        "-m",
        "axtorch.cli.tokenize",
        "data=text_files",
        f"data.source.paths=[{corpus}/*.txt]",
        "data.tokenizer.vocab_size=8192",
        f"out={out}",
        f"workers={workers}",
    ]
    # A fresh parent per run, so that its children's peak is this run's alone.
    measure = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", measure, *command], check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    peak_kib = int(result.stdout.split()[-1])  # the largest process: the writer or one encoding worker
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(shard["tokens"] for shards in manifest["splits"].values() for shard in shards)
    return seconds, tokens, peak_kib / 1024


def loader_tokens_per_second(shards: Path, batches: int) -> float:
    config = load_experiment_config(["data=tokenized", f"data.source.path={shards}", f"data.seq_len={SEQ_LEN}"])
    data = build_data(config.data)
    iterator = data.train_batches(BATCH)
    next(iterator)
    started = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * BATCH * SEQ_LEN / (time.perf_counter() - started)


def streaming_overrides(corpus: Path, cache: Path) -> list[str]:
    return [
        "data=jsonl",
        f"data.source.paths=[{corpus}/*.jsonl]",
        "data.source.streaming=true",
        "data.tokenizer.vocab_size=8192",
        f"data.seq_len={SEQ_LEN}",
        f"data.streams={STREAMS}",
        f"data.cache_dir={cache}",
    ]


def stream_in_child(corpus: Path, cache: Path, batches: int) -> dict[str, float]:
    """Run ``_child_stream`` in a fresh interpreter on one core; its figures and peak RSS (MiB)."""
    environment = {**os.environ, "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, __file__, "--child-stream", str(corpus), str(cache), str(batches)]
    result = subprocess.run(command, check=True, capture_output=True, text=True, env=environment)
    return json.loads(result.stdout.splitlines()[-1])


def _child_stream(corpus: Path, cache: Path, batches: int) -> None:
    """(a) rank 0 of ``RANKS``'s whole share of the corpus through the reader; (b) ``batches`` loader batches."""
    import resource

    import torch

    from axtorch.data.streaming import StreamingDataModule, is_held_out_text

    torch.set_num_threads(1)
    config = load_experiment_config(streaming_overrides(corpus, cache))
    data = build_data(config.data)
    assert isinstance(data, StreamingDataModule) and config.data.source is not None
    figures: dict[str, float] = {}
    if batches:
        iterator = data.train_batches(BATCH, 0, 1)
        started = time.perf_counter()  # from the first batch: its read-ahead tokenizing counts too
        for _ in range(batches):
            next(iterator)
        figures["loader_tokens_per_s"] = batches * BATCH * SEQ_LEN / (time.perf_counter() - started)
    source = config.data.source.build_streaming()
    started = time.perf_counter()
    documents = characters = 0
    per_rank = STREAMS // RANKS
    for part in range(per_rank):  # rank 0's virtual streams
        for text, _ in source.read_part(part, STREAMS, 0):
            documents += 1
            characters += len(text)
            is_held_out_text(text, config.data.val_fraction, config.data.seed)
    figures.update(
        documents=documents,
        read_mb_per_s=characters / 1e6 / (time.perf_counter() - started),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    print(json.dumps(figures))


def step_tokens_per_second(repeats: int) -> float:
    """The reference model's training step (``train_throughput.py``'s axtorch step), on every core."""
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from train_throughput import BATCH as STEP_BATCH
    from train_throughput import REFERENCE, build_models, make_axtorch_step, time_steps

    _, model = build_models()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, REFERENCE["vocab_size"], (2, STEP_BATCH, SEQ_LEN + 1), generator=generator)
    batches = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    step = make_axtorch_step()
    time_steps(model, step, batches[:1], optimizer)  # warm-up
    seconds = min(time_steps(model, step, batches, optimizer) for _ in range(repeats))
    return len(batches) * STEP_BATCH * SEQ_LEN / seconds


def streaming_tables(root: Path, sizes_mb: list[int], batches: int, step_repeats: int) -> None:
    cache = root / "stream-cache"
    print()
    print(f"| streamed JSONL corpus | documents | rank 0 of {RANKS}: documents read | read MB/s | peak RSS (MiB) |")
    print("|---|---|---|---|---|")
    rate = None
    for index, megabytes in enumerate(sizes_mb):
        corpus = root / f"stream-{megabytes}"
        count = synthesise_jsonl(corpus, megabytes)
        figures = stream_in_child(corpus, cache, batches if index == 0 else 0)
        rate = figures.get("loader_tokens_per_s", rate)
        print(
            f"| {megabytes} MB | {count:,} | {figures['documents']:,.0f} | {figures['read_mb_per_s']:.0f} | "
            f"{figures['peak_rss_mib']:.0f} |"
        )
        shutil.rmtree(corpus)
    step = step_tokens_per_second(step_repeats)
    assert rate is not None
    print()
    print("| streaming loader tokens/s (1 core) | training step tokens/s (same run) | ratio |")
    print("|---|---|---|")
    print(f"| {rate:,.0f} | {step:,.0f} | {rate / step:,.0f}x |")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child-stream":
        _child_stream(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[40, 160])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--step-tokens-per-s", type=float, default=1010.0, help="train_throughput.py's axtorch figure")
    parser.add_argument("--stream-sizes-mb", type=int, nargs="*", default=[500, 2000])
    parser.add_argument("--stream-batches", type=int, default=2000)
    parser.add_argument("--step-repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="axtorch-data-bench-"))
    try:
        print("| corpus | files | tokens | tokenize s | tokens/s | peak RSS (MiB) |")
        print("|---|---|---|---|---|---|")
        for megabytes in args.sizes_mb:
            corpus, out = root / f"corpus-{megabytes}", root / f"tokens-{megabytes}"
            files = synthesise(corpus, megabytes)
            seconds, tokens, peak = tokenize(corpus, out, args.workers)
            print(f"| {megabytes} MB | {files:,} | {tokens:,} | {seconds:.1f} | {tokens / seconds:,.0f} | {peak:.0f} |")
            shutil.rmtree(corpus)
        rate = loader_tokens_per_second(root / f"tokens-{args.sizes_mb[-1]}", args.batches)
        print()
        print("| loader tokens/s | training step tokens/s | ratio |")
        print("|---|---|---|")
        print(f"| {rate:,.0f} | {args.step_tokens_per_s:,.0f} | {rate / args.step_tokens_per_s:,.0f}x |")
        if args.stream_sizes_mb:
            streaming_tables(root, args.stream_sizes_mb, args.stream_batches, args.step_repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
