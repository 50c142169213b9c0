"""The suite's tiers: ``make test`` runs everything, ``make test-quick`` every test not marked ``journey``.

A journey starts another process of the project's kind: a Python interpreter (torchrun and its
workers, an XLA worker, the CLI, a documented command), a shell script (a launcher), a scheduler
command (Slurm) or a package tool. Such a test costs seconds of process start-up at the least, and
the quick tier leaves it out. The mark is kept honest here rather than by review: a test that
starts such a process without the mark fails, naming the command, in either tier. A compiler
started by a kernel's first build (axtorch's decode library, inductor) is no journey.

A ``-m`` expression naming a marker that is not registered is refused, naming the registered ones:
pytest would otherwise select nothing, or everything, without a word.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

#: Programs a test may start without being a journey: compilers, linkers and the build tool torch's
#: extension builder runs (a kernel's first build),
#: the small probes of the machine that libraries run, and a linter that answers in milliseconds.
NOT_JOURNEYS = frozenset(
    {
        *("cc", "gcc", "g++", "c++", "clang", "clang++", "ld", "ar", "nm", "ninja"),
        *("uname", "lscpu", "getconf", "nproc", "ldconfig"),
        "hadolint",
    }
)
#: Markers that pytest itself provides, which an ``-m`` expression may name too.
BUILTIN_MARKERS = frozenset({"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"})
_OPERATORS = frozenset({"and", "or", "not"})


def _program(args) -> str:
    first = args if isinstance(args, (str, bytes, Path)) else next(iter(args), "")
    first = first.decode() if isinstance(first, bytes) else str(first)
    return Path(first.split()[0] if first else "").name


def _is_journey(program: str) -> bool:
    return re.sub(r"-\d+(\.\d+)*$", "", program) not in NOT_JOURNEYS  # gcc-12 is gcc


class JourneyGuard:
    """Fails a test that starts a journey's process without carrying the ``journey`` mark."""

    def __init__(self) -> None:
        self.current: pytest.Item | None = None
        self.original = subprocess.Popen._execute_child  # type: ignore[attr-defined]
        guard = self

        def execute_child(popen, args, *rest, **options):
            guard.check(args)
            return guard.original(popen, args, *rest, **options)

        subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]

    def check(self, args) -> None:
        """Fail the running test if the process ``args`` names is a journey and the test is not marked one."""
        item = self.current
        if item is not None and item.get_closest_marker("journey") is None and _is_journey(_program(args)):
            raise pytest.fail.Exception(
                f"{item.nodeid} starts a process ({_program(args)!r}: {args!r:.200}) but is not marked "
                "journey: add @pytest.mark.journey (or the module's pytestmark), which keeps it out of "
                "make test-quick (tests/tiers.py)"
            )

    def _watching(self, item: pytest.Item):
        """Run a phase (set-up or call: a module fixture may start the processes) as ``item``'s."""
        self.current = item
        try:
            return (yield)
        finally:
            self.current = None

    pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_watching)
    pytest_runtest_call = pytest.hookimpl(wrapper=True)(_watching)


def check_marker_expression(config: pytest.Config) -> None:
    """Refuse ``-m`` naming a marker the suite does not register."""
    expression = config.getoption("markexpr") or ""
    registered = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    known = registered | BUILTIN_MARKERS
    unknown = sorted(set(re.findall(r"[A-Za-z_]\w*", expression)) - _OPERATORS - known)
    if unknown:
        raise pytest.UsageError(
            f"-m {expression!r} names {', '.join(repr(name) for name in unknown)}, which no test can carry; "
            f"the suite's markers are: {', '.join(sorted(registered))}"
        )


_GUARDS: list[JourneyGuard] = []


def check_journey(args) -> None:
    """For processes started other than by ``subprocess`` (``forked_ranks.py``'s, from a fork server)."""
    for guard in _GUARDS:
        guard.check(args)


def pytest_configure(config: pytest.Config) -> None:
    check_marker_expression(config)
    _GUARDS.append(JourneyGuard())
    config.pluginmanager.register(_GUARDS[-1], "axtorch-journey-guard")
