"""The suite's own tooling: the tiers (the journey mark kept honest, unknown markers and tiers
refused), where the time went (per file and per fixture), and the coverage floors."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiers import check_marker_expression

REPO = Path(__file__).resolve().parents[1]
HELPERS = ("conftest.py", "xdist_scheduling.py", "suite_timing.py", "tiers.py", "forked_ranks.py")
#: A module of three tests: one starts a Python process unmarked, one marked, one starts none.
MODULE = """
import subprocess
import sys
import time

import pytest


@pytest.fixture(scope="module")
def slow_setup():
    time.sleep(0.3)


def test_starts_python_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.journey
def test_starts_python_marked(slow_setup):
    spin = "import time; s = time.process_time(); any(time.process_time() - s >= 0.5 for _ in iter(int, 1))"
    subprocess.run([sys.executable, "-c", spin], check=True)  # half a CPU-second, in a subprocess


def test_starts_nothing(slow_setup):
    pass
"""
#: Ranks forked from a fork server (forked_ranks.py): the same mark, and their CPU counted.
RANKS_MODULE = """
import pytest
from forked_ranks import run_ranks


def test_forks_ranks_unmarked():
    run_ranks(1, "spin.py")


@pytest.mark.journey
def test_forks_ranks_marked():
    run_ranks(2, "spin.py")  # half a CPU-second in each rank
"""
SPIN = "import time; s = time.process_time(); any(time.process_time() - s >= 0.5 for _ in iter(int, 1))"


def _suite(directory: Path) -> None:
    for helper in HELPERS:
        (directory / helper).write_text((REPO / "tests" / helper).read_text())
    (directory / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n    journey: journey\n")
    (directory / "test_processes.py").write_text(MODULE)
    (directory / "test_ranks.py").write_text(RANKS_MODULE)
    (directory / "spin.py").write_text(SPIN)


def _pytest(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=300)


@pytest.mark.journey
def test_an_unmarked_test_that_starts_a_process_fails_and_the_quick_tier_leaves_the_marked_out(tmp_path):
    _suite(tmp_path)
    result = _pytest(tmp_path, "--durations=5", "--timings-json", "timings.json")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 failed, 3 passed" in result.stdout, result.stdout
    assert "test_starts_python_unmarked starts a process" in result.stdout and "not marked journey" in result.stdout
    assert "test_forks_ranks_unmarked starts a process" in result.stdout
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert set(timings["files"]) == {"test_processes.py", "test_ranks.py"}
    assert timings["cpu"]["test_ranks.py"] >= 1.0, timings  # the ranks, which the fork server waited for
    assert timings["fixtures"]["test_processes.slow_setup (module)"] >= 0.3
    # CPU seconds count the subprocess's spin, not the fixture's sleep
    assert 0.5 <= timings["cpu"]["test_processes.py"] <= timings["files"]["test_processes.py"] - 0.25, timings
    assert "where the time went" in result.stdout

    quick = _pytest(tmp_path, "-m", "not journey", "-k", "not unmarked")
    assert "1 passed, 4 deselected" in quick.stdout, quick.stdout + quick.stderr


def test_a_marker_expression_naming_an_unknown_marker_is_refused_with_the_known_ones():
    def config(expression: str) -> SimpleNamespace:
        return SimpleNamespace(
            getoption=lambda name: expression, getini=lambda name: ["slow: long", "journey: starts processes"]
        )

    check_marker_expression(config("not journey and not slow"))  # known: no error
    check_marker_expression(config("skip or xfail"))  # pytest's own
    with pytest.raises(pytest.UsageError, match=r"-m 'not jouney' names 'jouney'.*markers are: journey, slow"):
        check_marker_expression(config("not jouney"))


@pytest.mark.journey
def test_make_refuses_a_tier_that_does_not_exist_and_names_the_tiers():
    result = subprocess.run(["make", "-s", "test-fast"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "there is no test tier 'fast'" in result.stderr and "test-quick" in result.stderr, result.stderr


def _suite_report():
    spec = importlib.util.spec_from_file_location("suite_report", REPO / ".ci" / "suite_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_package_below_its_coverage_floor_fails_by_name_figure_and_floor(tmp_path, monkeypatch, capsys):
    report = _suite_report()
    floors = tmp_path / "floors.json"
    floors.write_text(json.dumps({"axtorch.data": {"lines": 80.0, "branches": 70.0}, "axtorch.gone": {"lines": 1}}))
    monkeypatch.setattr(report, "FLOORS", floors)
    figures = {"axtorch.data": {"lines": 79.4, "branches": 71.0}}
    failures = report.check_coverage(figures, check=True)
    assert failures == [
        "axtorch.data: lines covered 79.4%, below its floor of 80.0%",
        "axtorch.gone: has a floor in floors.json but no code was found (renamed? move its floor)",
    ]
    assert report.check_coverage(figures, check=False) == []  # a partial run prints, holds nothing
    assert "a partial run" in capsys.readouterr().out
    report.record_floors({"axtorch.data": {"lines": 79.4, "branches": 0.2}})
    assert json.loads(floors.read_text()) == {"axtorch.data": {"lines": 78.9, "branches": 0.0}}


def test_the_floors_name_every_package_of_axtorch():
    """A new package gets a floor when it lands (suite_report.py --record-floors), or nothing holds it."""
    floors = json.loads((REPO / ".ci" / "coverage_floors.json").read_text())
    packages = {".".join(path.relative_to(REPO).parts[:-1]) for path in (REPO / "axtorch").rglob("*.py")}
    assert packages - {"axtorch.conf"} <= set(floors), sorted(packages - set(floors))


@pytest.mark.journey
def test_a_phase_records_its_wall_time_status_and_how_busy_the_cores_were(tmp_path, capsys):
    env = {"REPORT": str(tmp_path), "PATH": "/usr/bin:/bin"}
    spin = [sys.executable, "-c", "import time; end = time.process_time() + 1\nwhile time.process_time() < end: pass"]
    started = time.monotonic()
    assert subprocess.run([REPO / ".ci" / "phase.sh", "spins", *spin], env=env).returncode == 0
    spun = time.monotonic() - started
    assert subprocess.run([REPO / ".ci" / "phase.sh", "fails", "false"], env=env).returncode == 1
    spins, fails = (line.split("\t") for line in (tmp_path / "phases.tsv").read_text().splitlines())
    # bash's SECONDS counts whole seconds: `false` reads 1 where it crossed one's boundary (a busy machine).
    assert spins[0] == "spins" and spins[2] == "0", spins
    assert 1 <= int(spins[1]) <= math.ceil(spun), (spins, spun)  # a second of CPU, within the wall time seen here
    assert fails[0] == "fails" and fails[1] in ("0", "1") and fails[2] == "1", fails
    if Path("/proc/stat").exists():  # one core spun for the phase, whatever else the machine did
        assert 100 / (os.cpu_count() or 1) * 0.5 <= int(spins[3].rstrip("%")) <= 100, spins
    _suite_report().print_phases(tmp_path)
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["phase", "wall", "cores", "busy", "status"]
    assert table[2].split() == ["fails", f"0:0{fails[1]}", fails[3], "FAILED", "(1)"]
