import json
import subprocess
import sys

import pytest


def _train(tmp_path, *overrides):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "axtorch.train",
            "experiment=debug",
            f"run_dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "trainer.progress_bar=false",
            *overrides,
        ],
        capture_output=True,
        text=True,
    )


@pytest.mark.journey
def test_train_command_runs_and_writes_the_run_directory(tmp_path):
    result = _train(tmp_path, "trainer.max_steps=6", "trainer.eval_every=3", "model/ffn=gelu")
    assert result.returncode == 0, result.stderr
    assert "held-out loss" in result.stdout
    run = tmp_path / "run"
    assert "MLPFeedForwardConfig" in (run / "config.yaml").read_text()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6


@pytest.mark.journey
def test_train_command_rejects_a_bad_override_before_any_work(tmp_path):
    result = _train(tmp_path, "trainer.max_step=6")
    assert result.returncode == 2
    assert "trainer.max_step" in result.stderr and "did you mean trainer.max_steps" in result.stderr
    assert not (tmp_path / "run").exists()
