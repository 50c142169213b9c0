#!/usr/bin/env bash
# Several machines: run this once on every node, with the same arguments and environment.
#
#   MASTER_ADDR=node0 NNODES=4 NPROC=8 launch/torchrun_multi_node.sh \
#       backend=native mesh.data=4 mesh.fsdp=8 sharding=fsdp trainer.batch_size=32 run_dir=/shared/runs/llama
#
# Every argument is a Hydra override passed unchanged to `python -m axtorch.train`; pass
# `backend=native`, and a mesh whose axes multiply to NNODES x NPROC (one axis may be -1).
# With mesh.data = NNODES and mesh.fsdp = NPROC, FSDP shards within a node and replicates across
# nodes (HSDP), so only the gradient all-reduce crosses the slower inter-node network.
#
# Environment (the same on every node):
#   MASTER_ADDR    required: a host name or address of one node, reachable from all the others;
#                  torchrun's c10d rendezvous store runs there
#   MASTER_PORT    a free TCP port on MASTER_ADDR (default 29500)
#   NNODES         number of nodes (default 1)
#   NPROC          processes per node, one per device (default: the GPUs nvidia-smi lists, else 1)
#   RDZV_ID        a job id shared by the nodes of one job (default: axtorch)
#   RDZV_BACKEND   c10d (default) or static
#   NODE_RANK      this node's index 0..NNODES-1. Only the static rendezvous uses it (torchrun
#                  ignores it under c10d, where nodes take ranks in the order they join);
#                  with static, the node with NODE_RANK=0 must be MASTER_ADDR.
#   RDZV_JOIN_TIMEOUT  seconds the rendezvous waits for all NNODES nodes (default 600): at start,
#                  and again after a failure, when torchrun restarts its workers (MAX_RESTARTS)
#                  and waits for every node to rejoin. It is what ends the surviving nodes when
#                  one is lost for good (see "A lost node" below).
#   OMP_NUM_THREADS  CPU threads per process (default: this machine's cores / NPROC, at least 1)
#   TORCHRUN       the torchrun to use (default: torchrun on PATH, else the repository's .venv)
#
# Shared storage: every process writes its own pieces of each checkpoint into one directory
# that the first process creates and renames, and every process looks for the newest
# checkpoint to resume from, so run_dir must be on a filesystem all nodes share. Each process
# also tokenizes the corpus into data.cache_dir unless that cache is already complete; put the
# cache on shared storage too (or fill it once beforehand) to do that work once.
#
# A lost node. When a node's processes die (crash, OOM kill, the machine gone with its
# connections reset), the others' collectives fail at once; each surviving torchrun restarts its
# workers and waits RDZV_JOIN_TIMEOUT for the lost node to rejoin, then exits non-zero
# (RendezvousTimeoutError). If MASTER_ADDR's node is the one lost, the others fail within
# seconds instead (the rendezvous store went with it). A node that hangs, or vanishes without
# resetting its connections, leaves the collectives waiting: the trainer's hang watchdog
# (trainer.watchdog_seconds, default 1800 s) ends its workers, then the same rejoin wait follows.
# Then start every node again: all processes resume from the newest checkpoint.
# (Restarting only the lost node while the others wait did not rejoin here, torch 2.13: the
# agents timed out reading the new round's keys from the store.) tests/parallel/test_multi_node.py
# runs this script as 2 nodes on one machine, kills one, and checks the timeout and the rerun.
#
# Exit status (launch/preemptible.sh runs torchrun): 0 when the run finished, 203 when a signal
# stopped it at a step boundary after saving ("resume me": start it again, no failure), torchrun's
# own status otherwise (docs/training.md, "Exit codes").
#
# Runs from the repository root, so a relative run_dir lands there.
#
# NCCL picks its network interface itself; set NCCL_SOCKET_IFNAME (and GLOO_SOCKET_IFNAME for
# CPU runs) when the nodes have several and it picks the wrong one.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${MASTER_ADDR:?set MASTER_ADDR to the host name or address of one node}"
MASTER_PORT=${MASTER_PORT:-29500}
NNODES=${NNODES:-1}
RDZV_ID=${RDZV_ID:-axtorch}
RDZV_BACKEND=${RDZV_BACKEND:-c10d}
RDZV_JOIN_TIMEOUT=${RDZV_JOIN_TIMEOUT:-600}

NPROC_FALLBACK=1
source launch/torchrun_env.sh

node_rank=()
if [[ "$RDZV_BACKEND" == static ]]; then
  : "${NODE_RANK:?set NODE_RANK (0..NNODES-1) for the static rendezvous}"
  node_rank=(--node-rank "$NODE_RANK")
fi

exec launch/preemptible.sh "$TORCHRUN" \
  --nnodes "$NNODES" \
  --nproc-per-node "$NPROC" \
  --max-restarts "$MAX_RESTARTS" \
  ${node_rank[@]+"${node_rank[@]}"} \
  --rdzv-id "$RDZV_ID" \
  --rdzv-backend "$RDZV_BACKEND" \
  --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
  --rdzv-conf "join_timeout=$RDZV_JOIN_TIMEOUT,timeout=$RDZV_JOIN_TIMEOUT" \
  -m axtorch.train "$@"
