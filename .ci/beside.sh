#!/usr/bin/env bash
# `make test`'s schedule: two lanes at once. The side lane (its own command line, first argument)
# runs beside the main one (the rest); its output is kept and shown whole after the main lane's,
# and the exit status is the main lane's, or else the side lane's.
#
# Why two lanes: most of the suites' tests wait on subprocesses part of the time (torchrun groups,
# XLA workers, Slurm's timeouts), so two pytest workers leave a core idle for a third of the
# newest suite (its CPU seconds against its wall seconds, in the report); and the newcomer's
# journey is pip unpacking on one core for the most part. The side lane (the journey, then the
# suite on torch 2.9.0 with one worker) fills that time instead of following it.
#
# Usage: .ci/beside.sh "SIDE COMMAND LINE" MAIN_COMMAND [ARG...]
set -uo pipefail
side="$1"
shift
log="$(mktemp)"
set -m  # the side lane gets its own process group, so that an interrupt can end all of it
bash -c "$side" </dev/null >"$log" 2>&1 &  # never reading the terminal (its own group may not)
lane=$!
set +m
trap 'kill -TERM -- "-$lane" 2>/dev/null; rm -f "$log"; exit 130' INT TERM

"$@"
status=$?
wait "$lane"
lane_status=$?
echo "---- the side lane ($side), run beside the command above ----"
cat "$log"
rm -f "$log"
if [ "$status" -ne 0 ]; then
  exit "$status"
fi
exit "$lane_status"
