"""The single-GPU benchmark script runs end to end; on a machine without a GPU, on the CPU at its smallest."""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.journey
def test_the_gpu_benchmark_script_runs_on_the_cpu_and_prints_its_table():
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_train.py"),
        *("--device", "cpu", "--model", "llama_debug", "--seq-len", "16", "--batch", "2"),
        *("--steps", "1", "--repeats", "1", "--no-compile"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("llama_debug: seq 16, batch 2, fp32, eager")
    same, difference = lines[1].split(" = ")
    assert same == "same function: max |logits difference| / max |logits|" and float(difference) < 1e-5
    assert [line.split(" | ")[0] for line in lines[4:6]] == ["| axtorch", "| hf_transformers"]
    assert lines[-1].startswith("ratio axtorch / hf_transformers: ")


def _run_benchmark(script: str, *arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "benchmarks" / script), *arguments]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.journey
def test_the_head_loss_benchmark_times_eager_and_compiled_chunks():
    result = _run_benchmark(
        "head_loss.py",
        *("--device", "cpu", "--tokens", "64", "--vocab", "512", "--dim", "32", "--steps", "1", "--repeats", "1"),
    )
    row = result.stdout.splitlines()[-1].strip("| ").split(" | ")
    assert row[0] == "1" and row[1].endswith("GFLOP/s"), result.stdout
    eager, compiled, ratio = (float(cell) for cell in row[2:])
    assert eager > 0 and compiled > 0 and ratio == pytest.approx(compiled / eager, abs=0.01)


@pytest.mark.journey
def test_the_host_gap_benchmark_times_the_gaps_of_a_real_run():
    result = _run_benchmark("host_gap.py", "trainer.max_steps=4")
    steps, gap = result.stdout.splitlines()[-2:]
    assert steps.startswith("steps: 4, median step "), result.stdout
    median = float(gap.split("median ")[1].split(" ms")[0])
    assert gap.startswith("host gap between steps: median") and 0 < median < 1000, gap


@pytest.mark.skipif(torch.cuda.is_available(), reason="here the script would run its whole benchmark")
def test_asking_for_a_gpu_where_there_is_none_says_so(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gpu_train.py", "--device", "cuda"])
    with pytest.raises(SystemExit, match="no CUDA device here"):
        runpy.run_path(str(ROOT / "benchmarks" / "gpu_train.py"), run_name="__main__")
