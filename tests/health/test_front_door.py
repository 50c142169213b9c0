"""Each package exports what scripts import, and the exports cost nothing until used."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = ["axtorch", "axtorch.infer", "axtorch.models", "axtorch.layers", "axtorch.interop", "axtorch.train"]
PACKAGES += ["axtorch.data", "axtorch.compose"]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_exported_name_resolves(name):
    package = importlib.import_module(name)
    missing = [export for export in package.__all__ if getattr(package, export, None) is None]
    assert not missing, f"{name}.__all__ names what it does not give: {missing}"
    assert package.__all__ == sorted(package.__all__)


def test_generate_is_the_function_and_its_module_stays_importable():
    from axtorch.infer import generate

    assert inspect.isfunction(generate) and generate.__module__ == "axtorch.infer.decoding"
    module = importlib.import_module("axtorch.infer.decoding")
    assert inspect.ismodule(module) and module.generate is generate


def test_the_top_level_exports_no_name_of_a_submodule():
    """``axtorch.generate`` and ``axtorch.plot`` are ``python -m`` entry points: a name of theirs would be ambiguous."""
    import axtorch

    submodules = {
        path.stem for path in Path(axtorch.__file__).parent.iterdir() if path.suffix == ".py" or path.is_dir()
    }
    assert not set(axtorch.__all__) & submodules


@pytest.mark.journey
def test_importing_a_package_or_a_piece_of_train_does_not_load_the_trainer():
    code = (
        "import sys, axtorch, axtorch.train, axtorch.train.flops; "
        "print(sorted(m for m in ('axtorch.train.trainer', 'axtorch.interop.hf') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
