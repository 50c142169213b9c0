"""Where the suite's time goes: each test file's total (set-up, call and tear-down of its tests)
in wall seconds and in CPU seconds (the test's process and the subprocesses it waited for:
torchrun groups, XLA workers, the documented commands), and each fixture's total set-up, summed
over the run, printed at the end and written as JSON for ``make test``'s phase table
(.ci/suite_report.py).

Wall seconds say what a worker waited for; CPU seconds say what the machine's cores spent, which
is what a 2-core run's length is made of once its workers are busy (a test that sleeps through a
Slurm timeout costs wall, not CPU).

``--durations`` names the slowest tests; these totals name the costly files and the shared set-up
(a torchrun group, a compiled XLA program, a converted model) that a new test may add to. Under
pytest-xdist each worker times its own fixtures and hands the figures to the controller, which
sees every test's report anyway.
"""

from __future__ import annotations

import json
import resource
import time
from collections import Counter
from pathlib import Path

import pytest

_FIXTURE_SECONDS = "axtorch_fixture_seconds"
_CPU_SECONDS = "axtorch_cpu_seconds"


_UNWAITED_CPU_SECONDS = [0.0]


def count_unwaited_cpu_seconds(seconds: float) -> None:
    """Add the CPU time of processes this one started but did not wait for (``forked_ranks.py``'s
    ranks, which their fork server waits for)."""
    _UNWAITED_CPU_SECONDS[0] += seconds


def cpu_seconds() -> float:
    """User and system time of this process, of the subprocesses it has waited for and of those counted
    by ``count_unwaited_cpu_seconds``."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _UNWAITED_CPU_SECONDS[0]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--timings-json",
        metavar="PATH",
        help="write each test file's and each fixture's total seconds to PATH (JSON)",
    )
    parser.addoption(
        "--timings-top", type=int, default=12, metavar="N", help="how many files and fixtures to print (default 12)"
    )


class SuiteTiming:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.files: Counter[str] = Counter()
        self.fixtures: Counter[str] = Counter()
        self.cpu: Counter[str] = Counter()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        start = cpu_seconds()
        try:
            return (yield)
        finally:
            self.cpu[item.nodeid.partition("::")[0]] += cpu_seconds() - start

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            module = getattr(fixturedef.func, "__module__", "?")
            self.fixtures[f"{module}.{fixturedef.argname} ({fixturedef.scope})"] += time.perf_counter() - start

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.files[report.nodeid.partition("::")[0]] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: the controller sums
            workeroutput[_FIXTURE_SECONDS] = json.dumps(self.fixtures)
            workeroutput[_CPU_SECONDS] = json.dumps(self.cpu)
            return
        path = self.config.getoption("timings_json")
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            figures = {"files": self.files, "cpu": self.cpu, "fixtures": self.fixtures}
            Path(path).write_text(json.dumps(figures, indent=1))

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        self.fixtures.update(json.loads(node.workeroutput.get(_FIXTURE_SECONDS, "{}")))
        self.cpu.update(json.loads(node.workeroutput.get(_CPU_SECONDS, "{}")))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        """Printed beside ``--durations`` (as make's suites ask), after the slowest tests."""
        if self.files and self.config.getoption("durations") is not None:
            top = self.config.getoption("timings_top")
            terminalreporter.write_sep("=", f"where the time went: the {top} costliest test files and fixtures")
            sections = (("test file", self.files), ("test file, CPU", self.cpu), ("fixture set-up", self.fixtures))
            for title, totals in sections:
                terminalreporter.write_line(f"{'seconds':>9}  {title} (of {sum(totals.values()):.0f} s in all)")
                for name, seconds in totals.most_common(top):
                    if seconds >= 0.05:
                        terminalreporter.write_line(f"{seconds:9.1f}  {name}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuiteTiming(config), "axtorch-suite-timing")
