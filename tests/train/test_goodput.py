"""Goodput across restarts: a run with a SIGTERM and a SIGKILL in the middle accounts for its wall time."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_runs import logged_steps

from axtorch.cli.plot import main as plot_main
from axtorch.train.goodput import CATEGORIES, read_attempts, run_totals

pytestmark = [pytest.mark.slow, pytest.mark.journey]


def _run_until(command: list[str], run_dir: Path, step: int, signal_number: int) -> None:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while logged_steps(run_dir) < step and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal_number)
    process.wait(timeout=300)


def test_a_sigterm_and_a_sigkill_leave_a_goodput_record_that_adds_up(tmp_path, capsys):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "axtorch.train",
        "experiment=debug",
        f"run_dir={run_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "trainer.max_steps=40",
        "trainer.checkpoint_every=10",
        "trainer.eval_every=20",
        "trainer.log_every=1",
        "trainer.progress_bar=false",
    ]
    _run_until(command, run_dir, 8, signal.SIGTERM)  # saves at its step, exits 203 ("resume me")
    _run_until(command, run_dir, 25, signal.SIGKILL)  # loses the steps since step 20's checkpoint
    subprocess.run(command, check=True, capture_output=True, timeout=600)

    attempts = read_attempts(run_dir)
    assert [a["attempt"] for a in attempts] == [0, 1, 2]
    first, second, third = (a["seconds"] for a in attempts)
    assert first["lost"] == 0 and second["lost"] > 0 and third["lost"] > 0
    assert first["redone"] == 0 and second["redone"] == 0  # a SIGTERM save loses no step
    assert third["redone"] > 0  # steps 21..25 again after the SIGKILL
    assert all(a["seconds"]["startup"] > 0 and a["seconds"]["productive"] > 0 for a in attempts)
    assert first["eval"] > 0 and third["checkpoint"] > 0
    totals = run_totals(attempts)
    wall = attempts[-1]["wall"] - attempts[0]["start"]
    assert sum(totals.values()) == pytest.approx(wall, rel=0.05)

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if "goodput/fraction" in m][-1]
    assert set(last) >= {f"goodput/{c}_s" for c in CATEGORIES}
    assert 0 < last["goodput/fraction"] < 1

    capsys.readouterr()
    assert plot_main([str(run_dir), "--goodput"]) == 0
    assert (run_dir / "goodput.png").stat().st_size > 10_000
    table = capsys.readouterr().out.splitlines()
    assert [row.split("|")[1].strip() for row in table[2:5]] == ["attempt 0", "attempt 1", "attempt 2"]
    whole = table[5].split("|")
    assert whole[1].strip() == "whole run"
    assert float(whole[-3]) == pytest.approx(sum(totals.values()), abs=0.1)
