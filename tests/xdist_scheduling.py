"""``make test``'s scheduling groups: each runs whole on one pytest-xdist worker (``conftest.py``
hands them to xdist), so a file's module fixtures run once and a document's commands run in order
in one directory. A module of its own, so that its test imports it by a name no other
``conftest`` shadows.
"""

from __future__ import annotations

from collections.abc import Callable

#: Tests whose cases run in finer scheduling groups than their file, by the case's id: a documented
#: command's id is ``<document>:<line>``, and a document's commands share its directory (one group
#: per document), while different documents share nothing.
FINER_GROUPS: dict[str, Callable[[str], str]] = {
    "tests/docs/test_doc_commands.py::test_doc_command": lambda case: case.rpartition(":")[0],
}


def scheduling_group(nodeid: str) -> str:
    """The group a test runs in under ``make test``: its file's, or a finer one of FINER_GROUPS.

    Each group runs whole on one pytest-xdist worker, so a file's module fixtures run once and a
    document's commands run in order in one directory.
    """
    path, _, rest = nodeid.partition("::")
    function, _, case = rest.partition("[")
    split = FINER_GROUPS.get(f"{path}::{function}")
    return f"{path}::{split(case.removesuffix(']'))}" if split is not None and case else path
