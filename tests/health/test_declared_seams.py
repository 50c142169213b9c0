"""Backends change a layer only through the seams it declares (``axtorch.layers.seams``).

A backend that assigned a hook onto a module by name (``module.some_hook = ...``) would change how
a layer runs without the layer saying so. Every attribute assignment in ``axtorch/parallel/`` is
read with ``ast``: besides a backend's own state (``self``), it may only replace a child module
the model declares (a pipeline stage drops the others) or set torch's own fields (a tensor's
``grad``, an autograd ``ctx``, a ``P2POp``'s tensor). Seams are filled with ``fill_seams``, by
their protocol, never assigned directly.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch

import axtorch.layers
from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.layers.seams import declared_seams, fill_seams

PARALLEL_DIR = Path(axtorch.layers.__file__).resolve().parent.parent / "parallel"
#: Fields of torch's own objects that backends set: a tensor's gradient, a P2POp's tensor.
TORCH_FIELDS = {"grad", "tensor"}
#: The context object torch passes to an autograd Function's forward and backward.
AUTOGRAD_CONTEXT = "ctx"


def _seams_by_class() -> dict[str, dict[str, type]]:
    seams = {}
    for info in pkgutil.iter_modules(axtorch.layers.__path__):
        module = importlib.import_module(f"axtorch.layers.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and "SEAMS" in vars(cls):
                seams[name] = dict(vars(cls)["SEAMS"])
    return seams


@pytest.fixture(scope="module")
def moe_config():
    """A model with every optional child: experts, an untied head, a learned position table."""
    overrides = ["model=qwen3_moe_tiny", "model.tie_embeddings=false", "model/position_embedding=learned"]
    return load_experiment_config(overrides).model


@pytest.fixture
def moe_model(moe_config):
    with torch.device("meta"):
        return moe_config.build()


def _assignments(path: Path) -> list[tuple[int, str, str]]:
    """``(line, object, attribute)`` of every attribute assignment and ``setattr`` call in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for item in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                if isinstance(item, ast.Attribute):
                    found.append((node.lineno, ast.unparse(item.value), item.attr))
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "object.__setattr__"):
            name = node.args[1]
            attribute = name.value if isinstance(name, ast.Constant) else f"<{ast.unparse(name)}>"
            found.append((node.lineno, ast.unparse(node.args[0]), str(attribute)))
    return found


def test_backends_assign_no_attribute_that_no_layer_declares(moe_model):
    seam_names = {name for seams in _seams_by_class().values() for name in seams}
    child_names = {name.rpartition(".")[2] for name, _ in moe_model.named_modules() if name}
    undeclared, direct = [], []
    for path in sorted(PARALLEL_DIR.glob("*.py")):
        for line, owner, attribute in _assignments(path):
            where = f"parallel/{path.name}:{line}: {owner}.{attribute}"
            if owner == "self" or owner == AUTOGRAD_CONTEXT or attribute in TORCH_FIELDS:
                continue
            if attribute in seam_names:
                direct.append(where)
            elif attribute not in child_names:
                undeclared.append(where)
    assert not undeclared, (
        f"backends assign attributes that no layer declares as a seam ({sorted(seam_names)}): {undeclared}"
    )
    assert not direct, f"seams assigned by name instead of fill_seams(model, Protocol, implementation): {direct}"


def test_backends_find_layers_without_duck_typing():
    """By declared slot (``modules_with_seam``) or class, never by probing for an attribute."""
    probes = [
        f"parallel/{path.name}:{node.lineno}: {ast.unparse(node)}"
        for path in sorted(PARALLEL_DIR.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"
    ]
    assert not probes, f"backends probe modules for attributes: {probes}"


def test_every_declared_seam_holds_a_default_of_its_protocol(moe_model):
    # Attention, the gated feed-forward, mixture of experts and decoder declare them; a new seam shows up here.
    assert {name: sorted(seams) for name, seams in _seams_by_class().items()} == {
        "Decoder": ["layer_runner"],
        "GatedFeedForward": ["gate_up_projection"],
        "GroupedQueryAttention": ["qkv_projection", "sequence_exchange"],
        "MixtureOfExperts": ["expert_compute"],
    }
    filled = 0
    for module in moe_model.modules():
        for name, protocol in declared_seams(module).items():
            assert isinstance(getattr(module, name), protocol), f"{type(module).__name__}.{name}"
            filled += 1
    assert filled == 1 + 3 * len(moe_model.decoder.layers)  # the decoder; attention's two and experts' in each layer


def test_fill_seams_fills_slots_by_protocol_only(moe_model):
    from axtorch.layers.mixture_of_experts import ExpertCompute, MixtureOfExperts

    def compute(experts, rows, counts):
        return rows

    assert fill_seams(moe_model, ExpertCompute, compute) == len(moe_model.decoder.layers)
    assert all(m.expert_compute is compute for m in moe_model.modules() if isinstance(m, MixtureOfExperts))
    with pytest.raises(TypeError, match="does not implement ExpertCompute"):
        fill_seams(moe_model, ExpertCompute, "not callable")
