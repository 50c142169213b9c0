"""The wheel ships every package and the Hydra configs (the newcomer job installs and runs it)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_axtorch_package_and_the_configs_are_listed_for_the_wheel():
    tomllib = pytest.importorskip("tomllib", reason="the standard library reads TOML from Python 3.11")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "axtorch").rglob("__init__.py")}
    assert set(setuptools["packages"]) == on_disk | {"axtorch.conf"}
    assert setuptools["package-dir"] == {"axtorch.conf": "conf"}


def test_the_configs_are_importable_as_a_package():
    conf = importlib.resources.files("axtorch.conf")
    assert (conf / "train.yaml").is_file()
    assert {p.name for p in (conf / "experiment").iterdir()} >= {"debug.yaml", "quickstart.yaml"}
