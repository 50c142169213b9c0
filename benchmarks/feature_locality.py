"""Feature locality: is every optional feature implemented in one place and switched on by config alone?

    .venv/bin/python benchmarks/feature_locality.py

The features are the options registered in ``axtorch.compose.registry.CHOICES``: each option's config
class and the module class its ``build`` returns (read from ``build``'s return annotation). For
each, every ``.py`` file under ``axtorch/`` is parsed with ``ast`` and searched for references by
name: imports, names, attribute access (``layers.RMSNorm``), calls and ``isinstance`` /
``type(...) is`` tests all reduce to these. A name counts only when it resolves to ``axtorch``
(``torch.nn.LayerNorm`` is not axtorch's ``LayerNorm``). Strings and docstrings do not count.

A feature is *local* when the only files outside its defining file that name it are

* ``axtorch/compose/registry.py``, the registry of choices, and
* the ``__init__.py`` of the defining package, provided it only re-exports (imports) the name.

Converters are reported in their own column and do not count against locality: translating
the composed model to another implementation necessarily names the features it maps. They are
the interop converters (``axtorch/interop/*``: HF and GGUF) and the compiled decode step's
(``axtorch/infer/native_layers.py``, which maps the layers it recognises onto ``decode_layer.c``
and leaves every other to its modules; ``tests/infer/test_native_layers.py`` holds each feature it
maps to the modules' logits).

A second check, family locality, does the same for the interop model families registered in
``axtorch.interop.families.FAMILIES``: a family (an adapter object, e.g. ``MIXTRAL``) is local when
no file besides its own (``families/mixtral.py``) and the family registry
(``families/__init__.py``) names its adapter or its module, or special-cases it by comparing a
value with its HF ``model_type`` or class name (``model_type == "mixtral"``). Adding a family is
then one file and one registry line.

A third check, backend freedom, asserts that nothing under ``axtorch/layers/`` or
``axtorch/models/`` imports (or reaches through an attribute) ``torch.distributed``,
``torch_xla`` or ``axtorch.parallel``: model code is single-device code, parallelised from outside.

Importable: ``feature_reports()``, ``family_reports()`` and ``backend_violations()`` return the data the tables print,
and ``tests/test_feature_locality.py`` asserts on them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "axtorch"
REGISTRY_FILE = "axtorch/compose/registry.py"
FAMILY_REGISTRY_FILE = "axtorch/interop/families/__init__.py"
CONVERTERS = ("axtorch/interop/", "axtorch/infer/native_layers.py")
BACKEND_FREE_DIRS = ("axtorch/layers/", "axtorch/models/")
FORBIDDEN_IMPORTS = ("torch.distributed", "torch_xla", "axtorch.parallel")


@dataclass(frozen=True)
class Reference:
    file: str  # repository-relative, forward slashes
    line: int
    name: str
    is_import: bool  # True when the reference is an import statement (a re-export in an __init__)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class FeatureReport:
    """One registered implementation: its config class, the module class it builds, who names them."""

    config_class: type
    module_class: Optional[type]
    choices: list[str]  # "group=option" entries that select this config class
    defining_file: str
    references: list[Reference] = field(default_factory=list)  # outside the defining file

    @property
    def names(self) -> list[str]:
        return [c.__name__ for c in (self.config_class, self.module_class) if c is not None]

    @property
    def registry(self) -> list[Reference]:
        return [r for r in self.references if r.file == REGISTRY_FILE]

    @property
    def re_exports(self) -> list[Reference]:
        package_init = str(Path(self.defining_file).parent / "__init__.py").replace("\\", "/")
        return [r for r in self.references if r.file == package_init and r.is_import]

    @property
    def converters(self) -> list[Reference]:
        return [r for r in self.references if r.file.startswith(CONVERTERS)]

    @property
    def non_local(self) -> list[Reference]:
        """References that make the feature non-local: anything not registry, re-export or converter."""
        allowed = set(self.registry) | set(self.re_exports) | set(self.converters)
        return [r for r in self.references if r not in allowed]

    @property
    def is_local(self) -> bool:
        return not self.non_local


@dataclass
class FamilyReport:
    """One registered interop family: where its adapter is defined and who else names it."""

    binding: str  # the adapter's module-level name, e.g. MIXTRAL
    model_type: str
    architecture: str
    defining_file: str
    references: list[Reference] = field(default_factory=list)  # outside the defining file

    @property
    def non_local(self) -> list[Reference]:
        return [r for r in self.references if r.file != FAMILY_REGISTRY_FILE]

    @property
    def is_local(self) -> bool:
        return not self.non_local


# ----------------------------------------------------------------------------------------------
# The features: everything CHOICES registers.


def registered_features() -> tuple[dict[type, list[str]], list[str]]:
    """{config class: ["group=option", ...]} and the options that register no class (e.g. qk_norm=none)."""
    from axtorch.compose.registry import CHOICES

    features: dict[type, list[str]] = {}
    empty: list[str] = []
    for group, (_, options) in CHOICES.items():
        for option, node in options.items():
            # A node is a config instance, or (for groups that fill several slots) a dict of them.
            nodes = list(node.values()) if isinstance(node, dict) else [node]
            classes = [type(n) for n in nodes if n is not None]
            if not classes:
                empty.append(f"{group}={option}")
            for cls in dict.fromkeys(classes):
                features.setdefault(cls, []).append(f"{group}={option}")
    return features, empty


def built_module_class(config_class: type) -> Optional[type]:
    """The class ``config_class.build`` returns, from its return annotation (None if it names none)."""
    build = getattr(config_class, "build", None)
    if build is None:
        return None
    returned = typing.get_type_hints(build).get("return")
    if inspect.isclass(returned) and returned.__module__.startswith(PACKAGE + "."):
        return returned
    return None


def _relative(path: Path) -> str:
    """A source file's path as the repository holds it, also where the package was imported from
    an installed wheel (the suite run against it, as on a GPU machine)."""
    resolved = path.resolve()
    package = Path(importlib.import_module(PACKAGE).__file__ or "").resolve().parent
    if resolved.is_relative_to(package):
        return (Path(PACKAGE) / resolved.relative_to(package)).as_posix()
    return resolved.relative_to(REPO_ROOT).as_posix()


# ----------------------------------------------------------------------------------------------
# Name resolution over the source tree.


def source_files() -> list[Path]:
    return sorted((REPO_ROOT / PACKAGE).rglob("*.py"))


def _module_name(relative_path: str) -> str:
    parts = relative_path[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` reads from, relative levels resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


@dataclass
class ParsedFile:
    path: str  # repository-relative
    tree: ast.Module
    #: local name -> dotted target it is bound to by an import or a top-level class definition
    bindings: dict[str, str]
    #: (dotted target, line) for every module and name an import statement reads
    imports: list[tuple[str, int]]


def parse(path: Path) -> ParsedFile:
    return parse_source(path.read_text(), _relative(path))


def parse_source(text: str, relative: str) -> ParsedFile:
    """Parse ``text`` as if it were the file at ``relative`` (repository-relative, e.g. ``axtorch/layers/x.py``)."""
    module = _module_name(relative)
    tree = ast.parse(text, filename=relative)
    bindings: dict[str, str] = {}
    imports: list[tuple[str, int]] = []
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            bindings[node.name] = f"{module}.{node.name}"
    for node in ast.walk(tree):  # function-local imports bind too (an approximation: scopes merged)
        if isinstance(node, ast.Import):
            for alias in node.names:
                imports.append((alias.name, node.lineno))
                if alias.asname:
                    bindings[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    bindings[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, module, relative.endswith("__init__.py"))
            imports.append((base, node.lineno))
            for alias in node.names:
                if alias.name == "*":
                    continue
                target = f"{base}.{alias.name}"
                imports.append((target, node.lineno))
                bindings[alias.asname or alias.name] = target
    return ParsedFile(relative, tree, bindings, imports)


def _dotted(node: ast.AST, bindings: dict[str, str]) -> Optional[str]:
    """``a.b.C`` with ``a`` resolved through the file's bindings; None if the chain has no Name root."""
    if isinstance(node, ast.Name):
        return bindings.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, bindings)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _expressions(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node, plus the parsed contents of string annotations (``x: "RMSNorm"``)."""
    for node in ast.walk(tree):
        yield node
        annotations = []
        if isinstance(node, ast.arg):
            annotations.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for annotation in annotations:
            if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                try:
                    parsed = ast.parse(annotation.value, mode="eval")
                except SyntaxError:
                    continue
                for inner in ast.walk(parsed):
                    inner.lineno = annotation.lineno  # report the annotation's line
                    yield inner


def references(parsed: ParsedFile, names: set[str]) -> list[Reference]:
    """Where ``parsed`` names an ``axtorch`` class called one of ``names``."""

    def is_ours(target: Optional[str]) -> Optional[str]:
        if target and target.startswith(PACKAGE + ".") and target.rsplit(".", 1)[-1] in names:
            return target.rsplit(".", 1)[-1]
        return None

    found: set[Reference] = set()
    for target, line in parsed.imports:
        if name := is_ours(target):
            found.add(Reference(parsed.path, line, name, is_import=True))
    for node in _expressions(parsed.tree):
        # An outer Attribute resolves the whole chain; inner Names resolve the root on their own.
        if isinstance(node, (ast.Name, ast.Attribute)) and (name := is_ours(_dotted(node, parsed.bindings))):
            found.add(Reference(parsed.path, node.lineno, name, is_import=False))
    return sorted(found, key=lambda r: (r.file, r.line, r.name))


# ----------------------------------------------------------------------------------------------
# The two checks.


def feature_reports(files: Optional[list[ParsedFile]] = None) -> list[FeatureReport]:
    files = files if files is not None else [parse(p) for p in source_files()]
    features, _ = registered_features()
    modules = {cls: built_module_class(cls) for cls in features}
    all_names = {c.__name__ for pair in modules.items() for c in pair if c is not None}
    found = [ref for parsed in files for ref in references(parsed, all_names)]  # one pass per file
    reports = []
    for config_class, choices in features.items():
        report = FeatureReport(
            config_class=config_class,
            module_class=modules[config_class],
            choices=choices,
            defining_file=_relative(Path(inspect.getsourcefile(config_class))),
        )
        defining_files = {report.defining_file}
        if report.module_class is not None:
            defining_files.add(_relative(Path(inspect.getsourcefile(report.module_class))))
        names = set(report.names)
        report.references = [r for r in found if r.name in names and r.file not in defining_files]
        reports.append(report)
    return reports


def _family_bindings() -> dict[str, tuple[object, str]]:
    """{adapter's module-level name: (adapter, defining file)} for every registered family."""
    import importlib

    from axtorch.interop.families import FAMILIES

    bindings: dict[str, tuple[object, str]] = {}
    for path in sorted((REPO_ROOT / FAMILY_REGISTRY_FILE).parent.glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(_module_name(_relative(path)))
        tree = ast.parse(path.read_text())
        assigned = {
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for name in assigned:
            if any(getattr(module, name) is family for family in FAMILIES):
                bindings[name] = (getattr(module, name), _relative(path))
    missing = [family.model_type for family in FAMILIES if all(family is not value for value, _ in bindings.values())]
    if missing:
        raise RuntimeError(f"registered families not assigned in a module of their own: {missing}")
    return bindings


def _compared_strings(parsed: ParsedFile) -> Iterator[tuple[str, int]]:
    """String constants a comparison tests against (``x == "mixtral"``, ``x in ("a", "b")``)."""
    for node in ast.walk(parsed.tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                for inner in ast.walk(operand):
                    if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                        yield inner.value, node.lineno


def family_reports(files: Optional[list[ParsedFile]] = None) -> list[FamilyReport]:
    files = files if files is not None else [parse(p) for p in source_files()]
    bindings = _family_bindings()
    reports = []
    for binding, (family, defining_file) in bindings.items():
        report = FamilyReport(binding, family.model_type, family.architecture, defining_file)  # type: ignore[attr-defined]
        module = _module_name(defining_file)
        for parsed in files:
            if parsed.path == defining_file:
                continue
            report.references += [
                Reference(parsed.path, line, target, is_import=True)
                for target, line in parsed.imports
                if target == module or target.startswith(module + ".")
            ]
            report.references += [
                Reference(parsed.path, line, value, is_import=False)
                for value, line in _compared_strings(parsed)
                if value in (report.model_type, report.architecture)
            ]
            report.references += [ref for ref in references(parsed, {binding}) if not ref.is_import]
        report.references = sorted(set(report.references), key=lambda r: (r.file, r.line, r.name))
        reports.append(report)
    return reports


def backend_violations(files: Optional[list[ParsedFile]] = None) -> list[str]:
    """``file:line target`` for every layers/models import or attribute chain into a parallel backend."""
    files = files if files is not None else [parse(p) for p in source_files()]

    def forbidden(target: Optional[str]) -> bool:
        return bool(target) and any(target == f or target.startswith(f + ".") for f in FORBIDDEN_IMPORTS)

    violations: set[tuple[str, int, str]] = set()
    for parsed in files:
        if not parsed.path.startswith(BACKEND_FREE_DIRS):
            continue
        for target, line in parsed.imports:
            if forbidden(target):
                violations.add((parsed.path, line, target))
        for node in ast.walk(parsed.tree):  # ``import torch`` then ``torch.distributed.all_reduce(...)``
            if (
                isinstance(node, ast.Attribute)
                and forbidden(target := _dotted(node, parsed.bindings))
                and not (isinstance(node.value, ast.Attribute) and forbidden(_dotted(node.value, parsed.bindings)))
            ):
                violations.add((parsed.path, node.lineno, target))
    return [f"{path}:{line} {target}" for path, line, target in sorted(violations)]


# ----------------------------------------------------------------------------------------------
# Printing.


def _files(refs: list[Reference]) -> str:
    by_file: dict[str, list[int]] = {}
    for ref in refs:
        by_file.setdefault(ref.file, []).append(ref.line)
    return ", ".join(f"{f} ({len(lines)})" for f, lines in by_file.items()) or "-"


def locality_table(reports: list[FeatureReport]) -> str:
    rows = [
        "| feature (config -> module) | choices | defined in | registry / re-exports | used by converters "
        "| other references | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        module = r.module_class.__name__ if r.module_class else "?"
        other = ", ".join(f"{ref} {ref.name}" for ref in r.non_local) or "-"
        rows.append(
            f"| {r.config_class.__name__} -> {module} | {', '.join(r.choices)} | {r.defining_file} "
            f"| {_files(r.registry + r.re_exports)} | {_files(r.converters)} | {other} "
            f"| {'local' if r.is_local else 'NOT LOCAL'} |"
        )
    return "\n".join(rows)


def family_table(reports: list[FamilyReport]) -> str:
    rows = [
        "| family (model_type: HF class) | adapter | defined in | references outside it and the registry | verdict |",
        "|---|---|---|---|---|",
    ]
    for r in reports:
        other = ", ".join(f"{ref} {ref.name}" for ref in r.non_local) or "-"
        rows.append(
            f"| {r.model_type}: {r.architecture} | {r.binding} | {r.defining_file} | {other} "
            f"| {'local' if r.is_local else 'NOT LOCAL'} |"
        )
    return "\n".join(rows)


def main() -> int:
    files = [parse(p) for p in source_files()]
    reports = feature_reports(files)
    families = family_reports(files)
    _, empty = registered_features()
    violations = backend_violations(files)

    print(f"## Feature locality ({len(reports)} registered implementations, {len(files)} files under axtorch/)\n")
    print(locality_table(reports))
    if empty:
        print(f"\nOptions that build nothing (no class to check): {', '.join(empty)}")
    local = sum(r.is_local for r in reports)
    print(f"\n{local}/{len(reports)} local. (n): how many references (names imported or used) that file holds.")

    local_families = sum(r.is_local for r in families)
    print(f"\n## Family locality ({len(families)} interop families registered in {FAMILY_REGISTRY_FILE})\n")
    print(family_table(families))
    print(f"\n{local_families}/{len(families)} local.")

    print(
        "\n## Backend freedom "
        "(axtorch/layers/, axtorch/models/ import no torch.distributed, torch_xla, axtorch.parallel)\n"
    )
    print("| check | result |\n|---|---|")
    print(f"| backend-free | {'yes' if not violations else 'NO: ' + '; '.join(violations)} |")
    return 0 if local == len(reports) and local_families == len(families) and not violations else 1


if __name__ == "__main__":
    raise SystemExit(main())
