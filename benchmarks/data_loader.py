"""What the data path costs: tokenizing a corpus into shards, reading batches from them, and streaming.

    .venv/bin/python benchmarks/data_loader.py [--sizes-mb 40 160] [--workers 2] [--batches 200]
        [--stream-sizes-mb 500 2000] [--stream-batches 2000] [--step-repeats 3]
        [--stream-ranks 2] [--memory-limit-mb N]

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

``--memory-limit-mb N`` runs each streaming child in a Linux memory cgroup limited to N MiB (page
cache included, reclaimed under the limit; no swap), so that a corpus of 10x N streams through a
process the kernel would kill for holding more: ``--stream-sizes-mb 10240 --memory-limit-mb 1024
--stream-ranks 1 --stream-batches 0`` is a corpus of 10x the memory the reader may use. It needs a
writable cgroup memory controller (v1 ``/sys/fs/cgroup/memory`` or v2), usually root.
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
STREAMS = 8


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


class MemoryCgroup:
    """A Linux memory cgroup (v1 or v2) limited to ``limit_mb`` MiB, page cache included, no swap."""

    def __init__(self, limit_mb: int):
        name = f"axtorch-bench-{os.getpid()}"
        v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
        self.v1 = v1.is_dir()
        self.path = (v1 if self.v1 else v2) / name
        try:
            self.path.mkdir()
        except OSError as error:
            raise SystemExit(f"--memory-limit-mb needs a writable cgroup memory controller: {error}") from error
        limit = str(limit_mb << 20)
        if self.v1:
            (self.path / "memory.limit_in_bytes").write_text(limit)
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(limit)
        else:
            (self.path / "memory.max").write_text(limit)
            (self.path / "memory.swap.max").write_text("0")

    def enter(self) -> None:
        """Move the calling process in (as a child's ``preexec_fn``)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_mib(self) -> float:
        peak = self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")
        return int(peak.read_text()) / 2**20 if peak.exists() else float("nan")

    def killed_for_memory(self) -> bool:
        events = self.path / ("memory.oom_control" if self.v1 else "memory.events")
        return any(
            line.split()[0] in ("oom_kill", "oom") and line.split()[1] != "0"
            for line in events.read_text().splitlines()
        )

    def remove(self) -> None:
        self.path.rmdir()


def stream_in_child(
    corpus: Path, cache: Path, batches: int, ranks: int, memory_limit_mb: int | None = None
) -> dict[str, float]:
    """Run ``_child_stream`` in a fresh interpreter on one core (in a memory cgroup if limited);
    its figures, peak RSS (MiB) and the cgroup's peak (page cache included)."""
    environment = {**os.environ, "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, __file__, "--child-stream", str(corpus), str(cache), str(batches), str(ranks)]
    cgroup = MemoryCgroup(memory_limit_mb) if memory_limit_mb else None
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, env=environment, preexec_fn=cgroup.enter if cgroup else None
        )
        if cgroup and cgroup.killed_for_memory():
            raise SystemExit(
                f"the streaming child exceeded {memory_limit_mb} MiB and was killed: {result.stderr[-2000:]}"
            )
        if result.returncode:
            raise SystemExit(f"the streaming child failed: {result.stderr[-4000:]}")
        figures = json.loads(result.stdout.splitlines()[-1])
        if cgroup:
            figures["cgroup_peak_mib"] = cgroup.peak_mib()
        return figures
    finally:
        if cgroup:
            cgroup.remove()


def _child_stream(corpus: Path, cache: Path, batches: int, ranks: int) -> None:
    """(a) rank 0 of ``ranks``'s whole share of the corpus through the reader; (b) ``batches`` loader batches."""
    import resource

    import torch

    from axtorch.data.held_out import is_held_out
    from axtorch.data.streaming import StreamingDataModule

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
    for part in range(STREAMS // ranks):  # rank 0's virtual streams
        for text, _ in source.read_part(part, STREAMS, 0):
            documents += 1
            characters += len(text)
            is_held_out(text, config.data.val_fraction, config.data.seed)
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


def streaming_tables(
    root: Path, sizes_mb: list[int], batches: int, step_repeats: int, ranks: int, memory_limit_mb: int | None
) -> None:
    cache = root / "stream-cache"
    limit = f" (limit {memory_limit_mb} MiB)" if memory_limit_mb else ""
    print()
    print(
        f"| streamed JSONL corpus | documents | rank 0 of {ranks}: documents read | read MB/s | peak RSS (MiB) "
        f"| cgroup peak{limit}, page cache included (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    rate = None
    for index, megabytes in enumerate(sizes_mb):
        corpus = root / f"stream-{megabytes}"
        count = synthesise_jsonl(corpus, megabytes)
        figures = stream_in_child(corpus, cache, batches if index == 0 else 0, ranks, memory_limit_mb)
        rate = figures.get("loader_tokens_per_s", rate)
        print(
            f"| {megabytes} MB | {count:,} | {figures['documents']:,.0f} | {figures['read_mb_per_s']:.0f} | "
            f"{figures['peak_rss_mib']:.0f} | {figures.get('cgroup_peak_mib', float('nan')):.0f} |"
        )
        shutil.rmtree(corpus)
    if rate is None:  # no loader batches asked for
        return
    step = step_tokens_per_second(step_repeats)
    print()
    print("| streaming loader tokens/s (1 core) | training step tokens/s (same run) | ratio |")
    print("|---|---|---|")
    print(f"| {rate:,.0f} | {step:,.0f} | {rate / step:,.0f}x |")


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child-stream":
        _child_stream(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="*", default=[40, 160], help="none: skip the tokenize tables")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--step-tokens-per-s", type=float, default=1010.0, help="train_throughput.py's axtorch figure")
    parser.add_argument("--stream-sizes-mb", type=int, nargs="*", default=[500, 2000])
    parser.add_argument("--stream-batches", type=int, default=2000)
    parser.add_argument("--step-repeats", type=int, default=3)
    parser.add_argument("--stream-ranks", type=int, default=2, help="the streaming child reads rank 0 of these")
    parser.add_argument("--memory-limit-mb", type=int, default=None, help="run streaming children in a memory cgroup")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="axtorch-data-bench-"))
    try:
        if args.sizes_mb:
            print("| corpus | files | tokens | tokenize s | tokens/s | peak RSS (MiB) |")
            print("|---|---|---|---|---|---|")
            for megabytes in args.sizes_mb:
                corpus, out = root / f"corpus-{megabytes}", root / f"tokens-{megabytes}"
                files = synthesise(corpus, megabytes)
                seconds, tokens, peak = tokenize(corpus, out, args.workers)
                rate = tokens / seconds
                print(f"| {megabytes} MB | {files:,} | {tokens:,} | {seconds:.1f} | {rate:,.0f} | {peak:.0f} |")
                shutil.rmtree(corpus)
            rate = loader_tokens_per_second(root / f"tokens-{args.sizes_mb[-1]}", args.batches)
            print()
            print("| loader tokens/s | training step tokens/s | ratio |")
            print("|---|---|---|")
            print(f"| {rate:,.0f} | {args.step_tokens_per_s:,.0f} | {rate / args.step_tokens_per_s:,.0f}x |")
        if args.stream_sizes_mb:
            streaming_tables(
                root,
                args.stream_sizes_mb,
                args.stream_batches,
                args.step_repeats,
                args.stream_ranks,
                args.memory_limit_mb,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
