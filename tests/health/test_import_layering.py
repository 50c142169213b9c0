"""The package import graph stays a drawable stack: no cycles, and each package imports only those below it.

Imports are read from the source (``ast``), including those inside functions, so a lazy import
counts like any other. ``__main__`` modules and the ``python -m axtorch.<command>`` shims are entry
points: they exist to import a CLI. Module by module, imports form no cycle either, counting those
inside functions and under ``if TYPE_CHECKING:``: such an import only hides a cycle, whose two
modules then cannot be read, tested or moved apart.
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
    "host": set(),
    "layers": {"config"},
    "models": {"config", "layers"},
    "data": {"config"},
    "infer": {"config", "host", "layers", "models"},
    "parallel": {"config", "host", "layers", "models"},
    "interop": {"config", "layers", "models", "data"},
    "train": {"config", "host", "layers", "models", "data", "parallel", "interop"},
    "compose": {"config", "host", "layers", "models", "data", "parallel", "interop", "train", "infer"},
    "plan": {"config", "host", "layers", "models", "data", "parallel", "interop", "train", "compose"},
    "cli": {"config", "host", "layers", "models", "data", "parallel", "interop", "train", "infer", "compose", "plan"},
}
ENTRY_POINT_SHIMS = {"ckpt.py", "export.py", "generate.py", "golden.py", "plot.py", "tokenize.py"}


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


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as its nodes, first repeated at the end, or None."""
    visiting: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return [*visiting[visiting.index(node) :], node]
        if node in done:
            return None
        visiting.append(node)
        for target in sorted(graph.get(node, ())):
            if cycle := visit(target):
                return cycle
        visiting.pop()
        done.add(node)
        return None

    return next((cycle for node in sorted(graph) if (cycle := visit(node))), None)


def _imports(tree: ast.Module, package: str) -> set[str]:
    """Every module ``tree`` imports, wherever it does: at load time, in a function, for types."""
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            modules.update(f"{module}.{alias.name}" for alias in node.names)  # a submodule, or a name of module
            modules.add(module)
    return modules


def module_imports() -> dict[str, set[str]]:
    """{module: {axtorch modules it imports}}, over every module of the package."""
    files = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[module] = (_imports(tree, package) & set(files)) - {module}
    return graph


def test_the_allowed_table_is_a_stack():
    cycle = find_cycle(ALLOWED)
    assert cycle is None, f"ALLOWED lets packages import each other: {' -> '.join(cycle)}"


def test_no_module_import_cycle():
    cycle = find_cycle(module_imports())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)} (give what both need a module of its own)"


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


def test_the_cycle_check_sees_a_cycle_however_it_is_hidden(tmp_path, monkeypatch):
    """Within one package, where the package table cannot see it; an import inside a function or
    under ``if TYPE_CHECKING:`` closes a cycle too (it only hides it from the import order)."""
    fake = tmp_path / "axtorch"
    (fake / "plan").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "plan" / "__init__.py").write_text("")
    (fake / "plan" / "a.py").write_text("from axtorch.plan.b import f\n")
    (fake / "plan" / "b.py").write_text("from axtorch.plan import c\n")
    (fake / "plan" / "c.py").write_text("import axtorch.plan.a\ndef f():\n    from axtorch.plan import b\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_ROOT", fake)
    assert find_cycle(module_imports()) == ["axtorch.plan.a", "axtorch.plan.b", "axtorch.plan.c", "axtorch.plan.a"]
    (fake / "plan" / "c.py").write_text("def f():\n    import axtorch.plan.a\n")
    assert find_cycle(module_imports()) == ["axtorch.plan.a", "axtorch.plan.b", "axtorch.plan.c", "axtorch.plan.a"]
    (fake / "plan" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from axtorch.plan import a\n"
    )
    assert find_cycle(module_imports()) == ["axtorch.plan.a", "axtorch.plan.b", "axtorch.plan.c", "axtorch.plan.a"]
    (fake / "plan" / "c.py").write_text("import axtorch.plan.d\n")
    assert find_cycle(module_imports()) is None
