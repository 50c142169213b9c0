"""A package's exports, imported on first use (PEP 562): ``from axtorch import Trainer`` works,
while ``import axtorch.config.errors`` still pays for nothing but the config package.

The package writes its exports as ordinary imports under ``if TYPE_CHECKING:``, so that readers
and type checkers see where each name comes from, and sets ``__getattr__ = lazy_exports(__name__,
__file__)``; those imports are the one list of exports, read once from the package's source.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def type_checking_imports(init_file: Path) -> dict[str, tuple[str, str]]:
    """{exported name: (module, attribute)} of the ``from x import y`` lines under ``if TYPE_CHECKING:``."""
    exports: dict[str, tuple[str, str]] = {}
    for node in ast.parse(init_file.read_text(), filename=str(init_file)).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom) and statement.module and statement.level == 0:
                    exports.update({a.asname or a.name: (statement.module, a.name) for a in statement.names})
    return exports


def lazy_exports(package: str, init_file: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: an exported name's module is imported when the name is first read."""
    exports: dict[str, tuple[str, str]] = {}

    def __getattr__(name: str) -> Any:
        if not exports:
            exports.update(type_checking_imports(Path(init_file)))
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = exports[name]
        value = getattr(importlib.import_module(module), attribute)
        setattr(sys.modules[package], name, value)  # read once: later reads find it directly
        return value

    return __getattr__
