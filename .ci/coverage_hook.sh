#!/usr/bin/env bash
# Install coverage.py's start-up hook into an environment: every Python process it runs then
# measures itself when COVERAGE_PROCESS_START names the configuration (make test sets it), and does
# nothing otherwise. The torchrun and XLA workers, the documented commands and the CLI
# subprocesses the suite starts are processes of these environments.
#
# Usage: .ci/coverage_hook.sh VENV
set -euo pipefail
site="$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
# One line, as a .pth file runs it: coverage is imported only when asked for.
echo 'import os; "COVERAGE_PROCESS_START" in os.environ and __import__("coverage").process_startup()' \
  > "$site/axtorch-coverage.pth"
