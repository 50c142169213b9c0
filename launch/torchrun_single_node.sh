#!/usr/bin/env bash
# One machine, several processes: torchrun with a local (standalone) rendezvous.
#
#   launch/torchrun_single_node.sh backend=native mesh.fsdp=-1 sharding=fsdp
#   NPROC=4 launch/torchrun_single_node.sh backend=native mesh.fsdp=2 mesh.model=2 sharding=fsdp_tp
#   NPROC=2 launch/torchrun_single_node.sh backend=native mesh.fsdp=-1 sharding=fsdp trainer.device=cpu
#
# Every argument is a Hydra override passed unchanged to `python -m axtorch.train`. Without
# `backend=native` each process would train alone on its own device: always pass it here.
# The mesh axes must multiply to NPROC (one axis may be -1 to take what the others leave).
#
# Environment:
#   NPROC             processes (one per device); default: the GPUs nvidia-smi lists, else 2
#   OMP_NUM_THREADS   CPU threads per process; default: this machine's cores / NPROC (at least 1)
#   TORCHRUN          the torchrun to use; default: torchrun on PATH, else the repository's .venv
#
# Runs from the repository root, so the default run_dir (runs/<experiment name>) lands there.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${NPROC:-}" ]]; then
  NPROC=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    NPROC=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
  fi
  (( NPROC > 0 )) || NPROC=2
fi

if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
  OMP_NUM_THREADS=$(( cores / NPROC > 0 ? cores / NPROC : 1 ))
fi
export OMP_NUM_THREADS

if [[ -z "${TORCHRUN:-}" ]]; then
  if command -v torchrun >/dev/null 2>&1; then
    TORCHRUN=torchrun
  else
    TORCHRUN=.venv/bin/torchrun
  fi
fi

exec "$TORCHRUN" --standalone --nnodes 1 --nproc-per-node "$NPROC" -m axtorch.train "$@"
