#!/usr/bin/env bash
# The newcomer's journey, as `make test` runs it: build a wheel, install it into a new, empty
# environment, and run the commands from a directory outside the repository.
#
# The environments (1.5 GB, then 8 GB for the XLA user's) and pip's downloads (several GB) go
# beside the repository's own environments (.venv-newcomer, git-ignored), on the disk that holds
# those, not in the temporary directory: the journey runs beside the suites, whose temporary files
# share that directory, and a CI machine's may be small (a run beside them once ran out of space
# there). Each environment is removed when done with.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
envs="$repo/.venv-newcomer"
trap 'rm -rf "$work" "$envs"' EXIT
rm -rf "$envs"
mkdir -p "$envs/tmp"
pip_install() { TMPDIR="$envs/tmp" "$1/bin/pip" install --quiet "${@:2}"; }

"$python" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$repo"
wheel="$(ls "$work"/dist/axtorch-*.whl)"
echo "built $(basename "$wheel")"
"$python" -m venv "$envs/latest"
pip_install "$envs/latest" "torch==2.13.0" "$wheel"

mkdir "$work/elsewhere" && cd "$work/elsewhere"
export PATH="$envs/latest/bin:$PATH"
set -x
axtorch-train experiment=debug data.cache_dir="$work/cache" trainer.progress_bar=false
axtorch-generate checkpoint=runs/debug prompt="def main(" max_new_tokens=16
axtorch-plan model=llama3_8b mesh.fsdp=8 sharding=fsdp
python -m axtorch.train experiment=debug trainer.max_steps=2 run_dir=runs/module data.cache_dir="$work/cache" trainer.progress_bar=false
set +x

# The XLA user's install, as the README gives it (torch 2.9.0 and torch_xla from the xla extra,
# float8 and hf beside it): pip must resolve the torchao built for torch 2.9, or transformers
# fails to import; then an XLA run on CPU virtual devices.
rm -rf "$envs/latest"
"$python" -m venv "$envs/xla"
pip_install "$envs/xla" "axtorch[xla,float8,hf] @ file://$wheel"
set -x
"$envs/xla/bin/python" -c "import torchao, transformers; print('torchao', torchao.__version__, 'transformers', transformers.__version__)"
PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 "$envs/xla/bin/python" -m axtorch.train backend=xla mesh.fsdp=-1 experiment=debug \
  trainer.max_steps=2 run_dir=runs/xla data.cache_dir="$work/cache" trainer.progress_bar=false
set +x
echo "newcomer journey: ok (${SECONDS} s)"
