"""What the data path costs: tokenizing a corpus into shards, and reading batches from them.

    .venv/bin/python benchmarks/data_loader.py [--sizes-mb 40 160] [--workers 2] [--batches 200]

For each size, synthesises a corpus of that many MB of text files (documents of 2-20 KB drawn
from the standard library's sources, repeated), runs ``axtorch-tokenize`` on it in a child
process and reports its tokens/s and the child's peak resident memory: memory that stays flat as
the corpus grows shows that tokenizing streams. Then it reads ``--batches`` training batches of
the reference shape (8 x 256 tokens, as ``train_throughput.py`` trains) from the largest
corpus's shards through ``DataModule``, and compares the loader's tokens/s with the training
step's, measured on the same machine by ``train_throughput.py`` (pass ``--step-tokens-per-s``).
"""

from __future__ import annotations

import argparse
import json
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


def synthesise(directory: Path, megabytes: int) -> int:
    """Text files totalling ``megabytes`` MB, cut from the standard library's sources; returns the file count."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = "\n".join(path.read_text(errors="replace") for path in sources)
    directory.mkdir(parents=True)
    written = count = 0
    offset = 0
    while written < megabytes * 1_000_000:
        size = 2_000 + (count * 7919) % 18_000
        chunk = text[offset : offset + size] or text[:size]
        offset = (offset + size) % max(1, len(text) - size)
        (directory / f"{count:07d}.txt").write_text(chunk)
        written += len(chunk.encode())
        count += 1
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[40, 160])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--step-tokens-per-s", type=float, default=1010.0, help="train_throughput.py's axtorch figure")
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
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
