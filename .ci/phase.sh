#!/usr/bin/env bash
# Run a command as one phase of `make test`: its name, wall time, exit status and how busy the
# machine's cores were meanwhile (every process's, from /proc/stat; "-" where there is none) are
# added to $REPORT/phases.tsv, which .ci/suite_report.py prints as the phase table.
#
# Usage: .ci/phase.sh NAME COMMAND [ARG...]
set -uo pipefail
# The cores' busy and total time since boot, in clock ticks: "busy total".
cpu_ticks() {
  [ -r /proc/stat ] && awk '/^cpu / { total = 0; for (i = 2; i <= NF; i++) total += $i; print total - $5 - $6, total }' /proc/stat
}
name="$1"
shift
start=$SECONDS
ticks_before="$(cpu_ticks)"
"$@"
status=$?
ticks_after="$(cpu_ticks)"
busy="-"
if [ -n "$ticks_before" ] && [ -n "$ticks_after" ]; then
  busy="$(echo "$ticks_before $ticks_after" | awk '{ if ($4 > $2) printf "%d%%", 100 * ($3 - $1) / ($4 - $2); else print "-" }')"
fi
mkdir -p "${REPORT:-.ci-report}"
printf '%s\t%d\t%d\t%s\n' "$name" "$((SECONDS - start))" "$status" "$busy" >>"${REPORT:-.ci-report}/phases.tsv"
exit "$status"
