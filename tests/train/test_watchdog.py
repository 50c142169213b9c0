"""A simulated hang trips the watchdog: every thread's stack is dumped, then the process exits 124 (or warns)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from quiet_runs import quiet_debug_run

from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.exit_codes import ExitCode
from axtorch.train.trainer import Trainer

HANGING_RUN = """
import sys, time
from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.train.trainer import Trainer

trainer = Trainer(load_experiment_config(sys.argv[1:]))
step = trainer.train_step

def train_step(batch):
    if trainer.step == 3:
        time.sleep(600)  # a collective that never returns
    return step(batch)

trainer.train_step = train_step
trainer.fit()
"""


def _overrides(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return quiet_debug_run(
        run_dir, cache, "trainer.max_steps=6", "trainer.eval_every=100", "trainer.watchdog_seconds=1", *extra
    )


@pytest.mark.journey
def test_a_hang_dumps_every_stack_and_exits_for_the_launcher_to_restart(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(HANGING_RUN), *_overrides(run_dir, data_cache)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == ExitCode.HUNG, result.stderr[-2000:]
    assert time.monotonic() - started < 120  # not the 600 s of the hang
    assert "no training step completed in 1 s" in result.stderr
    (dump,) = run_dir.glob("hang-rank0-*.txt")
    stacks = dump.read_text()
    assert stacks.count("Thread 0x") >= 1  # every thread, not only the watchdog's own
    assert "in train_step" in stacks and "in fit" in stacks  # where the main thread is stuck


def test_the_warn_action_dumps_and_lets_a_slow_step_finish(tmp_path, data_cache, capfd):
    trainer = Trainer(load_experiment_config(_overrides(tmp_path / "run", data_cache, "trainer.watchdog_action=warn")))
    step = trainer.train_step

    def slow_step(batch):
        if trainer.step == 3:
            time.sleep(2.5)
        return step(batch)

    trainer.train_step = slow_step
    assert trainer.fit().step == 6
    assert "no training step completed in 1 s" in capfd.readouterr().err
    assert list((tmp_path / "run").glob("hang-rank0-*.txt"))
