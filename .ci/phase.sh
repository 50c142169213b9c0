#!/usr/bin/env bash
# Run a command as one phase of `make test`: its name, wall time and exit status are added to
# $REPORT/phases.tsv, which .ci/suite_report.py prints as the phase table.
#
# Usage: .ci/phase.sh NAME COMMAND [ARG...]
set -uo pipefail
name="$1"
shift
start=$SECONDS
"$@"
status=$?
mkdir -p "${REPORT:-.ci-report}"
printf '%s\t%d\t%d\n' "$name" "$((SECONDS - start))" "$status" >>"${REPORT:-.ci-report}/phases.tsv"
exit "$status"
