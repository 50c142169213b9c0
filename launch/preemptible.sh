#!/usr/bin/env bash
# Runs a training command (torchrun ... -m axtorch.train ...) so that it ends with axtorch's exit
# codes, as `python -m axtorch.train` alone does: 0 when the run finished, 203 when a signal
# stopped it at a step boundary after saving (resume me: restart it, and count no failure), the
# command's own status otherwise (docs/training.md, "Exit codes").
#
#   launch/preemptible.sh torchrun --nproc-per-node 8 -m axtorch.train <overrides>
#
# Why a wrapper: torchrun reports its own status, not its workers'. It restarts a worker group in
# place whenever a worker exits non-zero, and when it is signalled itself it passes the signal on
# and exits 1 whatever its workers did. So here each training process writes 203 to
# $AXTORCH_STATUS_FILE and exits 0 when preempted (axtorch/train/exit_codes.py), and this script
# exits 203 when that file says so. SIGTERM and SIGINT sent to this script (a Kubernetes pod's
# first process, a Slurm step's task) go on to the command.
set -uo pipefail
(( $# > 0 )) || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }

AXTORCH_STATUS_FILE=$(mktemp "${TMPDIR:-/tmp}/axtorch-status.XXXXXX")
export AXTORCH_STATUS_FILE
trap 'rm -f "$AXTORCH_STATUS_FILE"' EXIT

"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM
trap 'kill -INT "$child" 2>/dev/null' INT
while kill -0 "$child" 2>/dev/null; do
  wait "$child"  # returns early when a trap runs
done
wait "$child"  # the command's own status, which bash keeps
status=$?

if [[ $(cat "$AXTORCH_STATUS_FILE") == 203 ]]; then
  echo "axtorch: the run was preempted and saved (command exit $status); exiting 203: restart it to resume" >&2
  exit 203
fi
exit "$status"
