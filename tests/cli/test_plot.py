"""axtorch-plot draws runs' curves from their metrics.jsonl and fails clearly without one."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import matplotlib.image
import numpy as np
import pytest
from matplotlib.colors import to_rgb

from axtorch.cli.plot import main
from axtorch.train.curves import plot_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: Pixels of a run's colour that only a drawn curve gives: the legend's samples have under 200, curves 1600+.
CURVE_PIXELS = 600


def _write_run(run_dir: Path, scale: float) -> Path:
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(1, 101):
        lines.append({"step": step, "train/loss": scale * 5.0 / step**0.5})
        if step % 20 == 0:
            lines.append({"step": step, "eval/loss": scale * 5.5 / step**0.5, "eval/perplexity": 2.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_dir


def _assert_png(path: Path, runs: int) -> None:
    """A PNG with the curves of ``runs`` runs: each run's colour (matplotlib's cycle) covers a
    curve's worth of pixels, and the next colour, which no run has, almost none."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    pixels = matplotlib.image.imread(path)[..., :3]
    cycle = [to_rgb(c) for c in matplotlib.rcParams["axes.prop_cycle"].by_key()["color"][: runs + 1]]
    counts = [int((np.abs(pixels - colour).max(axis=-1) < 0.1).sum()) for colour in cycle]
    assert all(count > CURVE_PIXELS for count in counts[:runs]), f"pixels per run colour: {counts[:runs]}"
    assert counts[runs] < CURVE_PIXELS, f"a colour no run has covers {counts[runs]} pixels"


def test_plot_two_runs(tmp_path: Path) -> None:
    runs = [_write_run(tmp_path / "baseline", 1.0), _write_run(tmp_path / "rope", 0.9)]
    out = plot_runs(runs, tmp_path / "plots" / "compare.png", title="baseline vs rope", log_y=True)
    assert out == tmp_path / "plots" / "compare.png"
    _assert_png(out, runs=2)


def test_cli_single_run_defaults_to_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path / "run", 1.0)
    assert main([str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "loss.png")
    _assert_png(run / "loss.png", runs=1)


def test_cli_several_runs_default_to_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [_write_run(tmp_path / "a", 1.0), _write_run(tmp_path / "b", 0.9)]
    monkeypatch.chdir(tmp_path)
    assert main([str(run) for run in runs] + ["--metrics", "train/loss", "eval/loss", "eval/perplexity"]) == 0
    assert capsys.readouterr().out.strip() == "loss.png"
    _assert_png(tmp_path / "loss.png", runs=2)


def test_cli_missing_metrics_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_cli_unknown_metric_names_the_logged_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path / "run", 1.0)
    assert main([str(run), "--metrics", "train/los"]) == 2
    assert "logged metrics: ['eval/loss', 'eval/perplexity', 'train/loss']" in capsys.readouterr().err
