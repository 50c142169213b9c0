"""Every experiment's and every model preset's resolved config, snapshotted as text: a changed default shows as a diff.

Regenerate after an intended change with ``AXTORCH_REGEN_GOLDEN=1 pytest tests/config/test_golden_configs.py``.
"""

import os
from pathlib import Path

import pytest

from axtorch.compose.experiment import conf_dir, load_experiment_config
from axtorch.config.serialize import config_to_yaml

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
EXPERIMENTS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))
MODEL_PRESETS = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))


def _check_golden(text: str, golden: Path) -> None:
    if os.environ.get("AXTORCH_REGEN_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"no golden config {golden.name}: run with AXTORCH_REGEN_GOLDEN=1"
    assert text == golden.read_text(), f"{golden} changed; regenerate with AXTORCH_REGEN_GOLDEN=1 if intended"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_config_matches_golden(experiment):
    _check_golden(config_to_yaml(load_experiment_config([f"experiment={experiment}"])), GOLDEN_DIR / f"{experiment}.yaml")


@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_model_preset_matches_golden(preset):
    model = load_experiment_config([f"model={preset}"]).model
    _check_golden(config_to_yaml(model), GOLDEN_DIR / "model" / f"{preset}.yaml")


def test_every_golden_file_has_an_experiment_or_a_preset():
    assert sorted(p.stem for p in GOLDEN_DIR.glob("*.yaml")) == EXPERIMENTS
    assert sorted(p.stem for p in (GOLDEN_DIR / "model").glob("*.yaml")) == MODEL_PRESETS
