#!/usr/bin/env bash
# TPU VM pod: start one training process on every host of the pod over gcloud ssh.
#
#   TPU_NAME=my-v5p-128 ZONE=us-east5-a launch/tpu_pod.sh mesh.fsdp=-1 sharding=fsdp model=llama3_8b \
#       trainer.batch_size=64 run_dir=/mnt/shared/runs/llama3_8b
#
# (v5p-128: 64 chips, so a batch of at least 64 rows; check it first on a laptop with the dry-run
# line in launch/README.md.)
#
# Runs the xla backend (torch_xla SPMD: one process per host driving all of the host's chips,
# PJRT_DEVICE=TPU), which the tests exercise on CPU virtual devices. Untested on a TPU pod: the
# several-host path (each host feeding its own rows and writing its own devices' checkpoint pieces,
# a preemption agreed by all hosts) has run only simulated on one machine (docs/parallelism.md,
# "Several hosts (TPU pods)", which lists what to check on a first pod run).
# The native backend (torchrun with NCCL or gloo) does not drive TPUs, so there is no torchrun
# variant here.
#
# Every argument is a Hydra override, passed (shell-quoted) to
#   cd $AXTORCH_DIR && PJRT_DEVICE=TPU python -m axtorch.train backend=xla <your overrides>
# on every host at once (--worker=all).
#
# Environment:
#   TPU_NAME      required: the TPU VM (pod slice) name
#   ZONE          required: its zone
#   PROJECT       the Google Cloud project (default: gcloud's configured project)
#   AXTORCH_DIR   the checkout on every host (default: ~/axtorch)
#   PYTHON        the interpreter on the hosts (default: python3)
#   CHECK_ON      a TPU hardware id (tpu-v5p-128): first compile the step here, on this machine,
#                 for that slice with the TPU compiler (axtorch-train dry_run=true ... hardware=...,
#                 the "tpu" extra installed here), and start nothing on the pod unless it fits
#   LOCAL_PYTHON  the interpreter here for that check (default: python3)
#
# Every host needs the same checkout at AXTORCH_DIR with axtorch installed with the xla extra
# (pip install -e ".[xla]") and libtpu (torch_xla's "tpu" extra), e.g. once with
#   gcloud compute tpus tpu-vm ssh $TPU_NAME --zone $ZONE --worker=all --command \
#       "git clone <your axtorch remote> ~/axtorch && cd ~/axtorch && pip install -e '.[xla]' 'torch_xla[tpu]'"
set -euo pipefail

: "${TPU_NAME:?set TPU_NAME to the TPU VM name}"
: "${ZONE:?set ZONE to the TPU VM zone}"
AXTORCH_DIR=${AXTORCH_DIR:-'~/axtorch'}
PYTHON=${PYTHON:-python3}

project=()
if [[ -n "${PROJECT:-}" ]]; then
  project=(--project "$PROJECT")
fi

overrides=""
if (( $# > 0 )); then
  overrides=$(printf ' %q' "$@")
fi
remote="cd $AXTORCH_DIR && PJRT_DEVICE=TPU $PYTHON -m axtorch.train backend=xla$overrides"

if [[ -n "${CHECK_ON:-}" ]]; then
  echo "before the pod: the step compiled for $CHECK_ON by the TPU compiler, here"
  if ! "${LOCAL_PYTHON:-python3}" -m axtorch.train dry_run=true backend=xla "hardware=$CHECK_ON" "$@"; then
    echo "tpu_pod.sh: the dry run for $CHECK_ON failed (exit 4: the step does not fit a chip); nothing started" >&2
    exit 1
  fi
fi

echo "on every host of $TPU_NAME: $remote"
exec gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" ${project[@]+"${project[@]}"} \
  --worker=all --command "$remote"
