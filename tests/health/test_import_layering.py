"""The package import graph stays a drawable stack: no cycles, and each package imports only those below it.

Imports are read from the source (``ast``), including those inside functions, so a lazy import
counts like any other. ``__main__`` modules and the ``python -m axtorch.<command>`` shims are entry
points: they exist to import a CLI.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "axtorch"

#: Each package and the axtorch packages it may import, bottom of the stack first.
ALLOWED = {
    "config": set(),
    "layers": {"config"},
    "models": {"config", "layers"},
    "data": {"config"},
    "infer": {"config", "layers", "models"},
    "parallel": {"config", "layers", "models"},
    "interop": {"config", "layers", "models", "data"},
    "train": {"config", "layers", "models", "data", "parallel", "interop"},
    "compose": {"config", "layers", "models", "data", "parallel", "interop", "train", "infer"},
    "plan": {"config", "layers", "models", "data", "parallel", "interop", "train", "compose"},
    "cli": {"config", "layers", "models", "data", "parallel", "interop", "train", "infer", "compose", "plan"},
}
ENTRY_POINT_SHIMS = {"generate.py", "plot.py"}


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "axtorch" and len(parts) > 1 else None


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def package_imports() -> dict[str, dict[str, set[str]]]:
    """{package: {imported package: {files importing it}}}, over every non-entry-point module."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        relative = path.relative_to(PACKAGE_ROOT)
        if path.name == "__main__.py" or (len(relative.parts) == 1 and path.name in ENTRY_POINT_SHIMS):
            continue
        if len(relative.parts) == 1:
            continue  # axtorch/__init__.py
        package = relative.parts[0]
        edges = graph.setdefault(package, {})
        for module in _imported_modules(path):
            target = _package_of(module)
            if target is not None and target != package:
                edges.setdefault(target, set()).add(str(relative))
    return graph


def test_every_package_has_a_place_in_the_stack():
    packages = {p.name for p in PACKAGE_ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(ALLOWED), f"add new packages to ALLOWED: {sorted(packages ^ set(ALLOWED))}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_packages_below_it(package):
    edges = package_imports().get(package, {})
    forbidden = {target: sorted(files) for target, files in edges.items() if target not in ALLOWED[package]}
    assert not forbidden, f"axtorch.{package} may import only {sorted(ALLOWED[package])}; found {forbidden}"


def test_package_graph_has_no_cycles():
    graph = {package: set(edges) for package, edges in package_imports().items()}
    visiting: list[str] = []
    done: set[str] = set()

    def visit(package: str) -> None:
        if package in visiting:
            cycle = [*visiting[visiting.index(package) :], package]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        if package in done:
            return
        visiting.append(package)
        for target in graph.get(package, ()):
            visit(target)
        visiting.pop()
        done.add(package)

    for package in graph:
        visit(package)


def test_nothing_imports_the_command_line_package():
    importers = {
        package: files
        for package, edges in package_imports().items()
        if package != "cli"
        for target, files in edges.items()
        if target == "cli"
    }
    assert not importers, f"only entry points may import axtorch.cli: {importers}"


def test_the_layering_check_sees_a_violation(tmp_path, monkeypatch):
    """The graph reader is not blind: a planted upward import is found."""
    fake = tmp_path / "axtorch"
    for package in ALLOWED:
        (fake / package).mkdir(parents=True)
        (fake / package / "__init__.py").write_text("")
    (fake / "layers" / "bad.py").write_text("def f():\n    from axtorch.train.trainer import Trainer\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_ROOT", fake)
    assert package_imports()["layers"] == {"train": {"layers/bad.py"}}
