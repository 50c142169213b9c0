#!/usr/bin/env bash
# Install axtorch and the named extras into an environment with uv (the newest environment's own):
# the XLA environment's 7 GB take about a minute instead of pip's five, and the two environments
# build at the same time (make -j2 environments).
#
# uv reads pip's settings from this machine's pip configuration (index, extra indexes, find-links,
# constraints), and, like pip, takes the best version across all of them.
# The dependencies are installed from pyproject.toml without building axtorch; then axtorch itself,
# in editable mode, one environment at a time: setuptools writes axtorch.egg-info beside the sources.
#
# Bytecode is compiled here, once, for everything installed and for the repository's own Python
# files: this machine's environment sets PYTHONDONTWRITEBYTECODE=1, so without it every process
# the suites start (torchrun and XLA workers, the documented commands, the CLI journeys) compiled
# torch and the rest from source again: a 3-step debug run took 29 s instead of 11.
#
# Usage: .ci/install.sh UV VENV "EXTRA,EXTRA" [REQUIREMENT...]
set -euo pipefail
uv="$1" venv="$2" extras="$3"
shift 3
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="$venv/bin/python"

pip_setting() {  # the effective value of one of pip's settings, words split, or nothing
  "$python" -m pip config list 2>/dev/null | sed -n "s/^[^=]*\.$1='\(.*\)'\$/\1/p" | tail -n 1 | tr '\n' ' '
}
options=(--python "$python" --index-strategy unsafe-best-match)
index="$(pip_setting index-url)"
[ -n "$index" ] && options+=(--default-index "$index")
for url in $(pip_setting extra-index-url); do options+=(--index "$url"); done
for place in $(pip_setting find-links); do options+=(--find-links "$place"); done
for file in $(pip_setting constraint); do options+=(--constraint "$file"); done
cert="$(pip_setting cert)"
[ -n "$cert" ] && export SSL_CERT_FILE="${cert% }"

extra_flags=()
IFS=',' read -ra names <<<"$extras"
for name in "${names[@]}"; do extra_flags+=(--extra "$name"); done

"$uv" pip install --quiet --compile-bytecode "${options[@]}" -r "$repo/pyproject.toml" "${extra_flags[@]}" "$@"
flock "$repo/.venv-install.lock" "$uv" pip install --quiet "${options[@]}" --no-deps -e "$repo"
flock "$repo/.venv-install.lock" "$python" -m compileall -q -j 0 "$repo/axtorch" "$repo/conf" "$repo/tests" "$repo/benchmarks" >/dev/null
