"""The end of ``make test``: the phase table, where the suites' time went, and coverage per package.

- Phases: each phase's wall time, how busy the machine's cores were meanwhile (every process's
  share, so a phase beside another counts both) and status (.ci/phase.sh writes them), and the
  whole run's. Cores far from 100% busy mean waiting: work could have filled them.
- Where the time went: each test file's total wall and CPU seconds and each fixture's wall
  seconds in either suite (tests/suite_timing.py writes them), the costliest first. A file whose
  CPU seconds are far below its wall seconds waits (on Slurm, on a subprocess's timeout).
- Coverage: the data of every process the suites started, combined; line and branch coverage of
  each package of axtorch/ beside its floor (.ci/coverage_floors.json). With ``--check-floors``
  (the whole suite ran) a package below its floor fails the run, by name.
- ``--record-floors`` writes the floors from this run's figures, less FLOOR_SLACK.

Usage: python .ci/suite_report.py REPORT_DIR [--check-floors | --record-floors]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOORS = REPO / ".ci" / "coverage_floors.json"
COVERAGE_DATA = REPO / ".coverage-data"
#: Points a package may fall below the figure its floor was recorded from: a few branches depend on
#: timing (a retry, a signal landing before or after a step), so two runs of the same code differ
#: by some tenths of a point.
FLOOR_SLACK = 0.5
#: The suites' timing files, by the column they fill.
SUITES = {"torch 2.13.0": "newest.json", "torch 2.9.0": "oldest.json"}
TOP = 15


def minutes(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def print_phases(report: Path) -> None:
    print(f"{'phase':<36}{'wall':>8}{'cores busy':>12}  status")
    path = report / "phases.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, seconds, status, busy = line.split("\t")
        outcome = "ok" if status == "0" else f"FAILED ({status})"
        print(f"{name:<36}{minutes(float(seconds)):>8}{busy:>12}  {outcome}")
    started = report / "started"
    if started.exists():
        print(f"{'make test, in all':<36}{minutes(time.time() - float(started.read_text())):>8}")


def print_costliest(report: Path) -> None:
    suites = {
        column: json.loads((report / name).read_text()) for column, name in SUITES.items() if (report / name).exists()
    }
    if not suites:
        return
    sections = (
        ("files", "test file", "wall seconds summed over workers"),
        ("cpu", "test file", "CPU seconds of its process and the subprocesses it waited for"),
        ("fixtures", "fixture set-up", "wall seconds summed over workers"),
    )
    for kind, title, unit in sections:
        totals: Counter[str] = Counter()
        for figures in suites.values():
            totals.update(figures.get(kind, {}))
        everything = sum(totals.values())
        print(f"\n{title}: the {TOP} costliest of {len(totals)}, {unit} ({everything:.0f} in all)")
        print("".join(f"{column:>14}" for column in suites) + f"{'total':>10}  {title}")
        for name, seconds in totals.most_common(TOP):
            row = "".join(f"{figures.get(kind, {}).get(name, 0.0):>14.1f}" for figures in suites.values())
            print(f"{row}{seconds:>10.1f}  {name}")


def package_of(path: str) -> str:
    """``axtorch/infer/decoding.py`` -> ``axtorch.infer``; a top-level module belongs to ``axtorch``."""
    return ".".join(Path(path).parts[:-1])


def coverage_by_package() -> dict[str, dict[str, float]]:
    """Line and branch coverage per package, from every process's data file, combined."""
    import coverage

    data_file = COVERAGE_DATA / ".coverage"
    cov = coverage.Coverage(data_file=str(data_file), config_file=str(REPO / "pyproject.toml"))
    cov.combine([str(COVERAGE_DATA)], keep=False)
    cov.save()
    cov.load()
    out = COVERAGE_DATA / "coverage.json"
    cov.json_report(outfile=str(out))
    sums: dict[str, Counter[str]] = {}
    for path, entry in json.loads(out.read_text())["files"].items():
        summary = entry["summary"]
        package = sums.setdefault(package_of(str(Path(path).resolve().relative_to(REPO))), Counter())
        for key in ("num_statements", "covered_lines", "num_branches", "covered_branches"):
            package[key] += summary[key]
    return {
        package: {
            "lines": round(100 * s["covered_lines"] / s["num_statements"], 1),
            # A package without branches leaves none uncovered.
            "branches": round(100 * s["covered_branches"] / s["num_branches"], 1) if s["num_branches"] else 100.0,
        }
        for package, s in sorted(sums.items())
        if s["num_statements"]  # conf/ (axtorch.conf) holds an empty __init__ beside its YAML
    }


def check_coverage(figures: dict[str, dict[str, float]], check: bool) -> list[str]:
    """Print each package's figures beside its floor; the failures, one line each, if ``check``."""
    floors = json.loads(FLOORS.read_text()) if FLOORS.exists() else {}
    scope = "the suite on torch 2.13.0 and every process it starts"
    print(f"\ncoverage of axtorch/ per package (line and branch %, {scope}), floors {FLOORS.name}")
    print(f"{'package':<28}{'lines':>8}{'floor':>8}{'branches':>10}{'floor':>8}")
    failures = []
    for package, figure in figures.items():
        floor = floors.get(package, {})
        print(
            f"{package:<28}{figure['lines']:>8.1f}{floor.get('lines', float('nan')):>8.1f}"
            f"{figure['branches']:>10.1f}{floor.get('branches', float('nan')):>8.1f}"
        )
        for kind in ("lines", "branches"):
            if kind in floor and figure[kind] < floor[kind]:
                failures.append(f"{package}: {kind} covered {figure[kind]:.1f}%, below its floor of {floor[kind]:.1f}%")
    for package in sorted(set(floors) - set(figures)):
        failures.append(f"{package}: has a floor in {FLOORS.name} but no code was found (renamed? move its floor)")
    if not check:
        print("(a partial run: the floors are not checked)")
        return []
    return failures


def record_floors(figures: dict[str, dict[str, float]]) -> None:
    floors = {
        package: {kind: round(max(0.0, value - FLOOR_SLACK), 1) for kind, value in figure.items()}
        for package, figure in figures.items()
    }
    FLOORS.write_text(json.dumps(floors, indent=1) + "\n")
    print(f"wrote {FLOORS}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check-floors", action="store_true", help="fail when a package falls below its floor")
    mode.add_argument("--record-floors", action="store_true", help="write the floors from this run")
    args = parser.parse_args()
    print("\n==== make test: the phases, where the time went, and coverage ====")
    print_phases(args.report)
    print_costliest(args.report)
    if not any(COVERAGE_DATA.glob(".coverage*")):
        print("\ncoverage: not measured (make test COVERAGE=1 measures it and holds the floors)")
        return 0
    figures = coverage_by_package()
    if args.record_floors:
        record_floors(figures)
    failures = check_coverage(figures, args.check_floors)
    for failure in failures:
        print(f"coverage floor: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
