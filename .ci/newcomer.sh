#!/usr/bin/env bash
# The newcomer's journey, as `make test` runs it: build a wheel, install it into a new, empty
# environment, and run the commands from a directory outside the repository.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$repo"
wheel="$(ls "$work"/dist/axtorch-*.whl)"
echo "built $(basename "$wheel")"
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet "torch==2.13.0" "$wheel"

mkdir "$work/elsewhere" && cd "$work/elsewhere"
export PATH="$work/venv/bin:$PATH"
set -x
axtorch-train experiment=debug data.cache_dir="$work/cache" trainer.progress_bar=false
axtorch-generate checkpoint=runs/debug prompt="def main(" max_new_tokens=16
axtorch-plan model=llama3_8b mesh.fsdp=8 sharding=fsdp
python -m axtorch.train experiment=debug trainer.max_steps=2 run_dir=runs/module data.cache_dir="$work/cache" trainer.progress_bar=false
set +x
echo "newcomer journey: ok"
