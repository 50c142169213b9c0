"""The exit codes the public texts name are the ones axtorch exits with (axtorch/train/exit_codes.py).

Launchers and schedulers' restart policies are written from these texts, so a code they name that
the code never uses sends a restart the wrong way. The phrases are found by a pattern of this
test's own, not by anything the project uses to print them.
"""

from __future__ import annotations

import re
from pathlib import Path

from axtorch.train.exit_codes import ExitCode

REPO = Path(__file__).parents[2]
#: "exit 203", "exits 4", "exiting 203", "exit code 124", "exits with 2", "exit 1-127" (a range).
PHRASE = re.compile(r"\bexit(?:s|ed|ing)?(?:\s+(?:with|code|status|of))*:?\s+(\d+(?:-\d+)?)\b", re.IGNORECASE)
#: Codes and ranges the texts name that axtorch does not exit with, and why they may.
ALLOWED = {
    "143": "128 + SIGTERM: the shell's status for a run a signal ends before axtorch handles signals",
    "1-127": "the codes Kubeflow's restartPolicy ExitCode fails a job on",
    "128-255": "the codes Kubeflow's restartPolicy ExitCode restarts a pod on, uncounted",
}


def _texts() -> dict[str, str]:
    """Each public text by its path: the documents whole, the launchers' comments alone (their code
    exits as it likes; its own tests run it), with each comment's ``#`` dropped so that a phrase
    wrapped over two comment lines still reads as one."""
    texts = {}
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "launch").rglob("*.md"))]:
        texts[str(path.relative_to(REPO))] = path.read_text()
    launchers = [*sorted((REPO / "launch").glob("*.sh")), REPO / "launch" / "slurm.sbatch"]
    for path in [*launchers, *sorted((REPO / "launch" / "kubernetes").glob("*.yaml"))]:
        comments = [re.match(r"(?:\s*#|.*\s\s#)\s?(.*)|", line)[1] or "" for line in path.read_text().splitlines()]
        texts[str(path.relative_to(REPO))] = "\n".join(comments)
    return texts


def _named() -> list[tuple[str, int, str]]:
    """(path, line, code) of every exit-code phrase in the public texts."""
    return [
        (name, text.count("\n", 0, match.start()) + 1, match[1])
        for name, text in _texts().items()
        for match in PHRASE.finditer(text)
    ]


def test_every_exit_code_the_texts_name_is_one_axtorch_exits_with_or_explained():
    codes = {str(int(code)) for code in ExitCode}
    wrong = [f"{name}:{line}: exit {code}" for name, line, code in _named() if code not in codes | ALLOWED.keys()]
    assert not wrong, "\n".join([f"not among axtorch's exit codes ({', '.join(sorted(codes, key=int))}):", *wrong])


def test_every_exit_code_axtorch_exits_with_is_named_in_the_texts():
    """The other way round, which also keeps the pattern from matching nothing and passing."""
    named = {code for _, _, code in _named()}
    assert {str(int(code)) for code in ExitCode} <= named
