#!/usr/bin/env bash
# One machine, several processes: torchrun with a local (standalone) rendezvous.
#
#   launch/torchrun_single_node.sh backend=native mesh.fsdp=-1 sharding=fsdp
#   NPROC=4 launch/torchrun_single_node.sh backend=native mesh.fsdp=2 mesh.model=2 sharding=fsdp_tp \
#       experiment=debug    # tensor parallelism needs untied embeddings: llama_debug has them
#   NPROC=2 launch/torchrun_single_node.sh backend=native mesh.fsdp=-1 sharding=fsdp trainer.device=cpu
#
# Every argument is a Hydra override passed unchanged to `python -m axtorch.train`. Always pass
# `backend=native`: without it every process trains the whole model by itself, all of them on
# the same default device and into the same run directory.
# The mesh axes must multiply to NPROC (one axis may be -1 to take what the others leave).
#
# Environment:
#   NPROC             processes (one per device); default: the GPUs nvidia-smi lists, else 2
#   OMP_NUM_THREADS   CPU threads per process; default: this machine's cores / NPROC (at least 1)
#   TORCHRUN          the torchrun to use; default: torchrun on PATH, else the repository's .venv
#
# Exit status (launch/preemptible.sh runs torchrun): 0 when the run finished, 203 when a signal
# stopped it at a step boundary after saving ("resume me": start it again, no failure), torchrun's
# own status otherwise (docs/training.md, "Exit codes").
#
# Runs from the repository root, so the default run_dir (runs/<experiment name>) lands there.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC_FALLBACK=2
source launch/torchrun_env.sh

exec launch/preemptible.sh "$TORCHRUN" --standalone --nnodes 1 --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS" \
  -m axtorch.train "$@"
