#!/usr/bin/env bash
# `make test`'s schedule: the newcomer's journey (.ci/newcomer.sh) runs beside the command given
# (check and both suites). The journey is set-up for the most part, pip unpacking ~7 GB on one core
# (3 min alone; check leaves a core idle, and the suites' workers wait on their subprocesses), so
# it overlaps them instead of following them. Its output is kept and shown whole after the
# command's, and the exit status is the command's, or else the journey's.
#
# Usage: .ci/with_newcomer.sh COMMAND [ARG...]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
log="$(mktemp)"
set -m  # the journey gets its own process group, so that an interrupt can end all of it
"$here/phase.sh" "newcomer's journey (beside)" "$here/newcomer.sh" </dev/null >"$log" 2>&1 &  # never reading the terminal (its own group may not)
journey=$!
set +m
trap 'kill -TERM -- "-$journey" 2>/dev/null; rm -f "$log"; exit 130' INT TERM

"$@"
status=$?
wait "$journey"
journey_status=$?
echo "---- the newcomer's journey (.ci/newcomer.sh, run beside the command above) ----"
cat "$log"
rm -f "$log"
if [ "$status" -ne 0 ]; then
  exit "$status"
fi
exit "$journey_status"
