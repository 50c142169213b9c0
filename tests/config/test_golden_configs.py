"""Every experiment's and every model preset's resolved config, snapshotted as text: a changed default shows as a diff.

Regenerate after an intended change with ``axtorch-golden action=write golden_dir=tests/golden``.
"""

from pathlib import Path

import pytest

from axtorch.cli.golden import main as golden_main
from axtorch.compose.golden import compare_golden, group_options, snapshot, snapshots

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
OPTIONS = [(group, option) for group in ("experiment", "model") for option in group_options(group)]


@pytest.mark.parametrize(("group", "option"), OPTIONS)
def test_config_matches_golden(group, option):
    golden = GOLDEN_DIR / group / f"{option}.yaml"
    assert golden.is_file(), f"no golden config {golden}: run axtorch-golden action=write golden_dir=tests/golden"
    assert snapshot(group, option) == golden.read_text(), (
        f"{golden} changed; run axtorch-golden action=write golden_dir=tests/golden if intended"
    )


def test_every_golden_file_has_an_experiment_or_a_preset():
    assert not compare_golden(GOLDEN_DIR, {f"{g}/{o}.yaml": "" for g, o in OPTIONS}).stale


USER_EXPERIMENT = """# @package _global_
defaults:
  - override /model: my_model
name: mine
trainer:
  max_steps: 3
"""


def _user_config_dir(root: Path) -> Path:
    (root / "experiment").mkdir(parents=True)
    (root / "model").mkdir()
    (root / "experiment" / "mine.yaml").write_text(USER_EXPERIMENT)
    (root / "model" / "my_model.yaml").write_text("defaults:\n  - llama_tiny\n  - _self_\ndim: 96\n")
    return root


def test_a_users_config_dir_gets_golden_snapshots_that_catch_a_changed_default(tmp_path, capsys):
    conf = _user_config_dir(tmp_path / "my_conf")
    golden = tmp_path / "golden"
    assert sorted(snapshots([conf])) == ["experiment/mine.yaml", "model/my_model.yaml"]
    assert golden_main(["check", "--config-dir", str(conf), "--golden-dir", str(golden)]) == 1  # nothing written yet
    assert golden_main(["write", "--config-dir", str(conf), "--golden-dir", str(golden)]) == 0
    assert "dim: 96" in (golden / "model" / "my_model.yaml").read_text()
    assert golden_main(["check", "--config-dir", str(conf), "--golden-dir", str(golden)]) == 0
    (conf / "model" / "my_model.yaml").write_text("defaults:\n  - llama_tiny\n  - _self_\ndim: 192\n")
    capsys.readouterr()
    assert golden_main(["check", "--config-dir", str(conf), "--golden-dir", str(golden)]) == 1
    out = capsys.readouterr().out
    assert "-dim: 96" in out and "+dim: 192" in out


def test_a_users_config_is_validated_like_axtorchs(tmp_path, capsys):
    conf = _user_config_dir(tmp_path / "my_conf")
    (conf / "model" / "my_model.yaml").write_text("defaults:\n  - llama_tiny\n  - _self_\ndimm: 96\n")
    assert golden_main(["check", "--config-dir", str(conf), "--golden-dir", str(tmp_path / "g")]) == 2
    assert "dimm" in capsys.readouterr().err
