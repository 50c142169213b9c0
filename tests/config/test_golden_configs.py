"""Every experiment's fully resolved config, snapshotted as text: a changed default shows as a diff.

Regenerate after an intended change with ``AXTORCH_REGEN_GOLDEN=1 pytest tests/config/test_golden_configs.py``.
"""

import os
from pathlib import Path

import pytest

from axtorch.config.compose import conf_dir, load_train_config
from axtorch.config.serialize import config_to_yaml

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
EXPERIMENTS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_config_matches_golden(experiment):
    text = config_to_yaml(load_train_config([f"experiment={experiment}"]))
    golden = GOLDEN_DIR / f"{experiment}.yaml"
    if os.environ.get("AXTORCH_REGEN_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"no golden config for {experiment}: run with AXTORCH_REGEN_GOLDEN=1"
    assert text == golden.read_text(), f"{experiment} config changed; regenerate with AXTORCH_REGEN_GOLDEN=1 if intended"


def test_every_golden_file_has_an_experiment():
    assert sorted(p.stem for p in GOLDEN_DIR.glob("*.yaml")) == EXPERIMENTS
