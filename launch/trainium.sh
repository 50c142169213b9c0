#!/usr/bin/env bash
# AWS Trainium (trn1 / trn2) launch, in two variants.
#
# UNTESTED ON HARDWARE: neither Neuron stack (TorchNeuron or torch-neuronx) can be installed in
# axtorch's CI, so this script has never run on a Trainium instance. Treat it as a starting
# point and expect to adjust it.
#
#   launch/trainium.sh mesh.fsdp=-1 sharding=fsdp model=llama3_8b trainer.batch_size=32             # VARIANT=native
#   VARIANT=xla launch/trainium.sh mesh.fsdp=-1 sharding=fsdp model=llama3_8b trainer.batch_size=32  # VARIANT=xla
#
# (trn1.32xlarge: 32 NeuronCores, so a batch of at least 32 rows; the dry-run line in
# launch/README.md checks it on a laptop.)
#
# Every argument is a Hydra override passed unchanged to `python -m axtorch.train`.
#
# VARIANT=native (default): TorchNeuron, the Neuron device as a native torch device type.
#   torchrun starts one process per NeuronCore and the native backend runs FSDP2 / DTensor over
#   them: `backend=native trainer.device=neuron`, mesh axes multiplying to NEURON_CORES x NNODES.
#   For trainer.device=neuron, axtorch.parallel.native imports torch_neuronx (which registers the
#   device and its collectives) and lets torch pick the process-group backend the device
#   registered. Untested: TorchNeuron cannot be installed in axtorch's CI. TorchNeuron's
#   documentation targets trn2 and later; check that it supports your instance type.
#
# VARIANT=xla: torch-neuronx, i.e. torch_xla with PJRT_DEVICE=NEURON, through axtorch's xla
#   backend (`backend=xla`): one process per host that sees all NEURON_CORES cores and shards
#   with XLA SPMD. The xla backend is tested on CPU virtual devices only; this variant starts one
#   host only (the backend's several-host path has run only simulated: docs/parallelism.md,
#   "Several hosts (TPU pods)").
#
# Environment:
#   VARIANT          native (default) or xla
#   NEURON_CORES     NeuronCores per instance (default 32: trn1.32xlarge has 16 Trainium chips
#                    with 2 cores each; trn2.48xlarge has 64 logical cores at its default LNC=2)
#   NNODES, MASTER_ADDR, MASTER_PORT   native variant on several instances: NNODES > 1 and
#                    MASTER_ADDR of one instance, run on every instance (c10d rendezvous, as in
#                    launch/torchrun_multi_node.sh); needs EFA, and run_dir on shared storage
#   MAX_RESTARTS     native variant: torchrun's in-place restarts of a failed worker group
#                    (default 3, as in launch/torchrun_env.sh); each resumes from the newest checkpoint
#   NEURON_COMPILE_CACHE_URL   where Neuron caches compiled graphs (read by Neuron itself)
#   TORCHRUN, PYTHON the torchrun / python of the Neuron virtual environment
#                    (default: torchrun / python3 on PATH)
#
# Exit status: 0 when the run finished, 203 when a signal stopped it at a step boundary after saving
# ("resume me": start it again, no failure), otherwise torchrun's own status (native: it runs under
# launch/preemptible.sh) or axtorch-train's (xla) (docs/training.md, "Exit codes").
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT=${VARIANT:-native}
NEURON_CORES=${NEURON_CORES:-32}
NNODES=${NNODES:-1}
TORCHRUN=${TORCHRUN:-torchrun}
PYTHON=${PYTHON:-python3}

if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
  OMP_NUM_THREADS=$(( cores / NEURON_CORES > 0 ? cores / NEURON_CORES : 1 ))
fi
export OMP_NUM_THREADS

case "$VARIANT" in
  native)
    # The Neuron framework assigns each torchrun process its own NeuronCore (the Neuron runtime
    # documentation: framework extensions set the NEURON_RT_* variables on your behalf), so
    # NEURON_RT_NUM_CORES / NEURON_RT_VISIBLE_CORES are left unset here.
    if (( NNODES > 1 )); then
      : "${MASTER_ADDR:?set MASTER_ADDR to the address of one instance for NNODES > 1}"
      # EFA for the collectives between instances.
      export FI_PROVIDER=${FI_PROVIDER:-efa}
      export FI_EFA_USE_DEVICE_RDMA=${FI_EFA_USE_DEVICE_RDMA:-1}
      rendezvous=(--nnodes "$NNODES" --rdzv-id "${RDZV_ID:-axtorch}" --rdzv-backend c10d
                  --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}")
    else
      rendezvous=(--standalone --nnodes 1)
    fi
    exec launch/preemptible.sh "$TORCHRUN" "${rendezvous[@]}" --nproc-per-node "$NEURON_CORES" --max-restarts "${MAX_RESTARTS:-3}" \
      -m axtorch.train backend=native trainer.device=neuron "$@"
    ;;
  xla)
    # One process owns every NeuronCore of the instance.
    export PJRT_DEVICE=NEURON
    export NEURON_RT_NUM_CORES=${NEURON_RT_NUM_CORES:-$NEURON_CORES}
    exec "$PYTHON" -m axtorch.train backend=xla "$@"
    ;;
  *)
    echo "trainium.sh: VARIANT=$VARIANT; allowed: native, xla" >&2
    exit 2
    ;;
esac
