"""``make test``'s scheduling groups (tests/xdist_scheduling.py, handed to xdist by tests/conftest.py):
each runs whole on one pytest-xdist worker, so a file's module fixture runs once, and the documented
commands split by document."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from xdist_scheduling import scheduling_group

REPO = Path(__file__).resolve().parents[1]
#: A module whose fixture notes each set-up, and enough tests for both workers to want some.
MODULE = """
import time

import pytest


@pytest.fixture(scope="module")
def noted():
    with open("setups.txt", "a") as setups:
        setups.write("{name}\\n")


@pytest.mark.parametrize("case", range(6))
def test_case(noted, case):
    time.sleep(0.1)
"""


def test_a_file_is_a_group_and_the_documented_commands_split_by_document():
    assert scheduling_group("tests/a/test_x.py::test_y[p-1]") == "tests/a/test_x.py"
    assert scheduling_group("tests/a/test_x.py::TestC::test_y") == "tests/a/test_x.py"
    docs = "tests/docs/test_doc_commands.py"
    assert scheduling_group(f"{docs}::test_doc_command[README.md:84]") == f"{docs}::README.md"
    assert scheduling_group(f"{docs}::test_doc_command[launch/k8s/README.md:9]") == f"{docs}::launch/k8s/README.md"
    assert scheduling_group(f"{docs}::test_doc_python_snippet[README.md:120]") == docs


def _suite(directory: Path, slow: dict[str, bool]) -> None:
    """The real conftest (with its scheduling rule) and a MODULE per name, marked slow or not."""
    for helper in ("conftest.py", "xdist_scheduling.py", "suite_timing.py", "tiers.py"):
        (directory / helper).write_text((REPO / "tests" / helper).read_text())
    (directory / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    journey: journey\n")
    for name, is_slow in slow.items():
        mark = "pytestmark = pytest.mark.slow\n" if is_slow else ""
        (directory / f"test_{name}.py").write_text(MODULE.format(name=name) + mark)


@pytest.mark.journey
def test_the_group_with_the_most_slow_tests_comes_first_in_its_own_order(tmp_path):
    _suite(tmp_path, {"b": True, "c": False})
    (tmp_path / "test_a.py").write_text("import pytest\n\n\n@pytest.mark.slow\ndef test_one():\n    pass\n")
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    six = [f"test_case[{i}]" for i in range(6)]
    assert ids == [f"test_b.py::{t}" for t in six] + ["test_a.py::test_one"] + [f"test_c.py::{t}" for t in six]


@pytest.mark.journey
def test_make_tests_two_workers_set_up_a_module_fixture_once(tmp_path):
    """The Makefile's xdist options on two workers (pytest 9.2 once made every test its own unit)."""
    parallel = re.search(r"^PARALLEL := (.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert parallel is not None
    _suite(tmp_path, {"a": False, "b": False})
    command = [sys.executable, "-m", "pytest", *parallel.group(1).split(), "-n", "2", "-p", "no:cacheprovider", "-q"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted((tmp_path / "setups.txt").read_text().split()) == ["a", "b"], result.stdout
