"""The launchers that start torchrun exit as ``axtorch-train`` does (launch/README.md): torchrun exits 1
when it is signalled, whatever its workers did, so a launcher that runs it bare turns a saved
preemption into a failure. A stand-in torchrun plays a preempted run: it writes 203 where
launch/preemptible.sh asks a worker to, then exits 1 as torchrun does."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from axtorch.train.exit_codes import ExitCode

pytestmark = pytest.mark.journey

REPO = Path(__file__).parents[2]
STAND_IN = """#!/usr/bin/env bash
echo "$@" > "$(dirname "$0")/args"
if [[ -n "${PREEMPT:-}" && -n "${AXTORCH_STATUS_FILE:-}" ]]; then echo 203 > "$AXTORCH_STATUS_FILE"; fi
exit 1
"""


#: What each launcher puts between torchrun's own options and the overrides.
FIXED = {
    "torchrun_single_node.sh": "-m axtorch.train",
    "torchrun_multi_node.sh": "-m axtorch.train",
    "trainium.sh": "-m axtorch.train backend=native trainer.device=neuron",
}


@pytest.mark.parametrize("script", sorted(FIXED))
def test_a_preempted_run_exits_203_and_a_failed_one_torchruns_status(tmp_path, script):
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(STAND_IN)
    torchrun.chmod(0o755)
    env = os.environ | {"TORCHRUN": str(torchrun), "NPROC": "2", "NEURON_CORES": "2", "MASTER_ADDR": "localhost"}

    def launch(**extra: str) -> subprocess.CompletedProcess:
        command = [str(REPO / "launch" / script), "experiment=debug"]
        return subprocess.run(command, env=env | extra, capture_output=True, text=True, timeout=60)

    preempted = launch(PREEMPT="1")
    assert preempted.returncode == ExitCode.PREEMPTED, preempted.stderr
    assert (tmp_path / "args").read_text().rstrip().endswith(f"{FIXED[script]} experiment=debug")
    assert launch().returncode == 1  # torchrun's own status
