# Sourced by the torchrun launchers: fills NPROC, OMP_NUM_THREADS, TORCHRUN and MAX_RESTARTS when unset.
# MAX_RESTARTS: how often torchrun restarts a failed worker group in place (default 3); each restart
# resumes from the newest valid checkpoint by itself. A config error fails every attempt the same
# way, so it is reported MAX_RESTARTS + 1 times before torchrun gives up.
# NPROC_FALLBACK is the process count used when no GPU is listed.

if [[ -z "${NPROC:-}" ]]; then
  NPROC=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    NPROC=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
  fi
  (( NPROC > 0 )) || NPROC=${NPROC_FALLBACK:-1}
fi

if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
  OMP_NUM_THREADS=$(( cores / NPROC > 0 ? cores / NPROC : 1 ))
fi
export OMP_NUM_THREADS

if [[ -z "${TORCHRUN:-}" ]]; then
  if command -v torchrun >/dev/null 2>&1; then
    TORCHRUN=torchrun
  else
    TORCHRUN=.venv/bin/torchrun
  fi
fi

MAX_RESTARTS=${MAX_RESTARTS:-3}
