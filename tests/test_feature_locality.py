"""Every registered feature is implemented in one place, and layers/models stay backend-free.

A change that makes a parent layer special-case a feature (``isinstance(cfg.position,
NoPositionConfig)`` in attention, say) or that reaches from model code into a parallel backend
fails here. The analysis itself lives in ``benchmarks/feature_locality.py``, which prints it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_TOOL_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "feature_locality.py"


@pytest.fixture(scope="module")
def tool():
    name = "feature_locality"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _TOOL_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their module through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def files(tool):
    return [tool.parse(path) for path in tool.source_files()]


def test_every_registered_feature_is_local(tool, files):
    reports = tool.feature_reports(files)
    assert reports, "no features found in CHOICES"
    offenders = {
        f"{r.config_class.__name__} (defined in {r.defining_file})": [f"{ref} names {ref.name}" for ref in r.non_local]
        for r in reports
        if not r.is_local
    }
    assert not offenders, (
        "features named outside their defining file, the registry (axtorch/compose/registry.py), their "
        f"package's re-exports and the interop converters: {offenders}"
    )


def test_every_interop_family_is_one_file_and_one_registry_line(tool, files):
    reports = tool.family_reports(files)
    assert {r.model_type for r in reports} >= {"gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"}
    offenders = {f"{r.model_type} ({r.defining_file})": [f"{ref} {ref.name}" for ref in r.non_local] for r in reports}
    assert not any(offenders.values()), f"families named outside their file and the family registry: {offenders}"


def test_the_check_catches_code_special_casing_a_family(tool, files):
    special_case = tool.parse_source(
        "from axtorch.interop.families.mixtral import MIXTRAL\n"
        "def experts(hf):\n"
        "    if hf['model_type'] in ('qwen3_moe', 'other'):\n"
        "        return 1\n"
        "    return MIXTRAL\n",
        "axtorch/interop/special_case.py",
    )
    reports = {r.model_type: r for r in tool.family_reports([*files, special_case])}
    assert [str(ref) for ref in reports["qwen3_moe"].non_local] == ["axtorch/interop/special_case.py:3"]
    # The import of its module (and of the adapter from it), and the use of the adapter.
    assert [f"{ref} {ref.name}" for ref in reports["mixtral"].non_local] == [
        "axtorch/interop/special_case.py:1 axtorch.interop.families.mixtral",
        "axtorch/interop/special_case.py:1 axtorch.interop.families.mixtral.MIXTRAL",
        "axtorch/interop/special_case.py:5 MIXTRAL",
    ]
    assert reports["qwen2"].is_local


def test_every_feature_builds_an_axtorch_module(tool, files):
    """The check reads ``build``'s return annotation; a feature without one would escape half the check."""
    missing = [r.config_class.__name__ for r in tool.feature_reports(files) if r.module_class is None]
    assert not missing, f"annotate build() with the module class it returns: {missing}"


def test_layers_and_models_are_backend_free(tool, files):
    assert tool.backend_violations(files) == []


def test_the_check_catches_a_parent_layer_special_casing_a_feature(tool, files):
    special_case = tool.parse_source(
        "import torch\n"
        "from axtorch.layers import position\n"
        "from axtorch.layers.norm import LayerNorm as OurLayerNorm\n"
        "def forward(cfg, x):\n"
        "    if isinstance(cfg.position, position.NoPositionConfig):\n"
        "        return torch.nn.LayerNorm(4)(x)\n"  # torch's LayerNorm is not axtorch's
        "    return x\n",
        "axtorch/layers/special_case.py",
    )
    reports = {r.config_class.__name__: r for r in tool.feature_reports([*files, special_case])}
    assert [str(ref) for ref in reports["NoPositionConfig"].non_local] == ["axtorch/layers/special_case.py:5"]
    assert [str(ref) for ref in reports["LayerNormConfig"].non_local] == ["axtorch/layers/special_case.py:3"]
    assert reports["RMSNormConfig"].is_local


def test_the_check_catches_backend_imports_in_model_code(tool):
    model_code = tool.parse_source(
        "import torch\n"
        "from ..parallel import mesh\n"
        "def f(x):\n"
        "    torch.distributed.all_reduce(x)\n"
        "    import torch_xla.core.xla_model as xm\n",
        "axtorch/models/leaky.py",
    )
    assert tool.backend_violations([model_code]) == [
        "axtorch/models/leaky.py:2 axtorch.parallel",
        "axtorch/models/leaky.py:2 axtorch.parallel.mesh",
        "axtorch/models/leaky.py:4 torch.distributed",
        "axtorch/models/leaky.py:5 torch_xla.core.xla_model",
    ]
