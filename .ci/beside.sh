#!/usr/bin/env bash
# `make test`'s schedule: one phase runs beside a command, in the background, so that the two share
# the machine's cores instead of taking turns. The suites' workers wait on their subprocesses
# (torchrun groups, Slurm's timeouts, the documented commands) and the newcomer's journey is mostly
# pip unpacking on one core: beside each other they fill those gaps. The phase's output is kept and
# shown whole after the command's; the exit status is the command's, or else the phase's.
#
# Usage: .ci/beside.sh "PHASE NAME" PHASE-COMMAND [ARG...] -- COMMAND [ARG...]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
name="$1"
shift
phase=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do phase+=("$1"); shift; done
[ "$#" -gt 0 ] || { echo "usage: $0 NAME PHASE-COMMAND... -- COMMAND..." >&2; exit 2; }
shift
log="$(mktemp)"
set -m  # the phase gets its own process group, so that an interrupt can end all of it
"$here/phase.sh" "$name" "${phase[@]}" </dev/null >"$log" 2>&1 &  # never reading the terminal (its own group may not)
beside=$!
set +m
trap 'kill -TERM -- "-$beside" 2>/dev/null; rm -f "$log"; exit 130' INT TERM

"$@"
status=$?
wait "$beside"
beside_status=$?
echo "---- $name: run beside the command above ----"
cat "$log"
rm -f "$log"
if [ "$status" -ne 0 ]; then
  exit "$status"
fi
exit "$beside_status"
