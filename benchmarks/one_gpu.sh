#!/usr/bin/env bash
# The checks a lent CUDA GPU runs, in one call (docs/benchmarks.md, "One GPU"): axtorch installed
# from its wheel with the packages the GPU image lacks (.whl, made beside the repository by
# `benchmarks/one_gpu_wheels.sh`), then
#   1. training tokens/s and MFU against HF transformers (benchmarks/gpu_train.py),
#   2. a real training run of llama3_1b on the GPU, whose peak memory the dry run predicts
#      (`axtorch-train dry_run=true` with the same settings, traced on the CPU),
#   3. the same model in bf16 through the trainer, as a user runs it,
#   4. the quick tier of the suite on the GPU image's torch, with CUDA present.
# Logs go to $OUT (the device tool's folder) or /tmp/one-gpu.
#
# Usage: benchmarks/one_gpu.sh [SECTION...]   (all four when none is named)
set -u
sections=" ${*:-1 2 3 4} "
runs() { [[ "$sections" == *" $1 "* ]]; }
out=${OUT:-/tmp/one-gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -c "import torch, axtorch; print('torch', torch.__version__, torch.cuda.get_device_name())"

runs 1 && {
echo "== 1. gpu_train.py"
timeout 240 python3 benchmarks/gpu_train.py --model llama3_1b --seq-len 2048 --batch 4 2>&1 | tee "$out/gpu_train.txt" | grep -v Warning
echo "-- the fused head's chunks, eager and compiled (trainer.compile compiles them on CUDA)"
timeout 90 python3 benchmarks/head_loss.py 2>&1 | tee "$out/head_loss.txt" | grep -v Warning

}
runs 2 && {
echo "== 2. the real step's peak memory (the dry run's figure comes from the same settings)"
settings=(model=llama3_1b trainer.batch_size=4 data.seq_len=2048 trainer.log_every=1)
timeout 110 axtorch-train "${settings[@]}" trainer.max_steps=3 run_dir=/tmp/real >"$out/real_run.txt" 2>&1
tail -3 "$out/real_run.txt"
python3 - <<'PY'
import json
rows = [json.loads(line) for line in open("/tmp/real/metrics.jsonl")]
print("real run, train/memory_gb (torch.cuda.max_memory_allocated, GiB):", [round(r["train/memory_gb"], 3) for r in rows if "train/memory_gb" in r])
print("tokens/s:", [round(r["train/tokens_per_s"]) for r in rows if "train/tokens_per_s" in r])
PY

}
runs 3 && {
echo "== 3. the default trainer in bf16, compiled (tokens/s and MFU as a user's run logs them)"
# trainer.compile is on by default on CUDA: the first window holds the layers' compile.
timeout 150 axtorch-train "${settings[@]}" trainer.precision=bf16 trainer.max_steps=24 trainer.log_every=4 run_dir=/tmp/bf16 >"$out/bf16_run.txt" 2>&1
grep -E "^compile|torch.compile compiled" "$out/bf16_run.txt"
python3 - <<'PY'
import json
rows = [json.loads(line) for line in open("/tmp/bf16/metrics.jsonl")]
print([(r["step"], round(r["train/tokens_per_s"]), round(r["train/mfu"], 3), round(r["train/memory_gb"], 2)) for r in rows if "train/mfu" in r])
goodput = [json.loads(line) for line in open("/tmp/bf16/goodput.jsonl")][-1]["seconds"]
print("goodput seconds:", {k: round(v, 1) for k, v in goodput.items()})
PY
echo "-- the host's gap between two steps (what the GPU idles for while the trainer reads a step's numbers)"
timeout 120 python3 benchmarks/host_gap.py "${settings[@]}" trainer.precision=bf16 trainer.max_steps=12 2>&1 | tail -2

}
runs 4 && {
echo "== 4. the quick tier on this torch, with CUDA"
# -P: the installed wheel's axtorch, not the repository's (which lacks the configs it installs).
timeout 140 python3 -P -m pytest -m "not journey" -n 12 -q -p no:cacheprovider -o addopts="" --tb=short -W ignore 2>&1 | tee "$out/quick_tier.txt" | tail -25
}
