"""Every shell command and Python snippet of the documentation runs, as written (docs/testing.md).

One case per command of each ```bash block of README.md, docs/*.md, launch/README.md and
launch/*/README.md, and one per ```python snippet of README.md and docs/*.md; a case's id is the
document and line. The commands of one document run in order, as a reader runs them, in one fresh
directory outside the repository (so the installed ``axtorch.conf`` configs are used, and a
command can use what an earlier one wrote); running one case alone first runs the document's
earlier commands. What the test changes, and only that, is in ``doc_blocks.as_run``: step and
evaluation limits on training runs, TPU lines on CPU virtual devices, the benchmark at its smallest.

A command that needs what this machine lacks says so in the document, ending in
``# needs: <what>``, and is skipped with that reason; any other command that fails, fails here.
"""

from __future__ import annotations

import os
import subprocess
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from doc_blocks import (
    REPO,
    TRAINING_LIMITS,
    Block,
    DocCommand,
    DocSnippet,
    as_run,
    collect,
    shell_commands,
    uses_xla,
)

VENV_BIN = REPO / ".venv" / "bin"
XLA_VENV_BIN = REPO / ".venv-xla" / "bin"
#: Linked into every command's directory, so that ``.venv/bin/...``, ``.venv-xla/bin/python``,
#: ``launch/*.sh`` and ``benchmarks/*.py`` written relative to the repository resolve.
LINKED = (".venv", ".venv-xla", "launch", "benchmarks")
#: The README's setup commands: they create the environments and run this very suite.
SETUP_COMMANDS = {("README.md", "make train"), ("README.md", "make test")}
SETUP_REASON = "the README's setup command; CI runs it as .ci/run"
#: Per command; the slowest, the throughput benchmark, takes one to two minutes.
TIMEOUT_S = 600
OUTPUT_TAIL_CHARS = 4000

COMMANDS, SNIPPETS = collect()

# Minutes on a 2-core machine: about 25 training runs; the throughput benchmark alone takes about
# half a minute or more.
pytestmark = [pytest.mark.slow, pytest.mark.journey]


@dataclass
class Outcome:
    command: DocCommand
    run: str
    returncode: int
    output: str
    seconds: float

    def report(self, earlier_failures: list[str]) -> str:
        tail = self.output.replace("\r", "\n")[-OUTPUT_TAIL_CHARS:]
        lines = [
            f"{self.command.id}: exit status {self.returncode} after {self.seconds:.0f}s",
            f"  as written: {self.command.text}",
            f"  as run:     {self.run}",
        ]
        if earlier_failures:
            lines.append(f"  (earlier commands of this document failed too: {', '.join(earlier_failures)})")
        return "\n".join([*lines, "--- output (tail) ---", tail])


@dataclass
class DocumentRun:
    """One document's directory and the outcomes of its commands so far, by line."""

    directory: Path
    outcomes: dict[int, Outcome] = field(default_factory=dict)


def skip_reason(command: DocCommand) -> str | None:
    if (command.doc, command.text) in SETUP_COMMANDS:
        return SETUP_REASON
    if command.needs:
        return f"needs: {command.needs}"
    return None


def command_env(home: Path, xla: bool = False) -> dict[str, str]:
    """The caller's environment with the project's venv first on PATH and a scratch HOME.

    HOME holds the tokenized-corpus cache (~/.cache/axtorch/data) and ~/corpus, the small text
    corpus the README's ``data=text_files`` example reads.
    """
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AXTORCH_", "PJRT_", "XLA_", "TPU_")) and key not in ("CPU_NUM_DEVICES", "PYTHONPATH")
    }
    bins = [XLA_VENV_BIN, VENV_BIN] if xla else [VENV_BIN]
    env["PATH"] = os.pathsep.join([*map(str, bins), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(bins[0].parent)
    env["HOME"] = str(home)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def run_shell(command: DocCommand, directory: Path, home: Path) -> Outcome:
    run = as_run(command.text)
    started = time.perf_counter()
    try:
        result = subprocess.run(
            ["bash", "-c", run],
            cwd=directory,
            env=command_env(home, uses_xla(run)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=TIMEOUT_S,
        )
        returncode, output = result.returncode, result.stdout
    except subprocess.TimeoutExpired as error:
        output = error.stdout.decode(errors="replace") if isinstance(error.stdout, bytes) else (error.stdout or "")
        returncode, output = -1, f"{output}\n[timed out after {TIMEOUT_S}s]"
    return Outcome(command, run, returncode, output, time.perf_counter() - started)


@pytest.fixture(scope="session")
def doc_home(tmp_path_factory) -> Path:
    """A scratch HOME with ~/corpus/{a,b}/*.txt: 30 standard-library sources as plain text."""
    home = tmp_path_factory.mktemp("doc-home")
    sources = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.stat().st_size > 4000)[:30]
    for i, source in enumerate(sources):
        target = home / "corpus" / "ab"[i % 2] / f"{source.stem}.txt"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source.read_text(errors="replace"))
    return home


@pytest.fixture(scope="session")
def document_runs(tmp_path_factory, doc_home):
    """Run a command after the earlier ones of its document, all in the document's own directory."""
    documents: dict[str, DocumentRun] = {}

    def run_through(command: DocCommand) -> tuple[Outcome, list[str]]:
        if command.doc not in documents:
            directory = tmp_path_factory.mktemp(command.doc.replace("/", "_") + "-")
            assert REPO not in directory.resolve().parents, "the commands must not run inside the repository"
            for name in LINKED:
                (directory / name).symlink_to(REPO / name)
            documents[command.doc] = DocumentRun(directory)
        document = documents[command.doc]
        earlier = [c for c in COMMANDS if c.doc == command.doc and c.line <= command.line]
        for sibling in earlier:
            if sibling.line not in document.outcomes and (sibling is command or skip_reason(sibling) is None):
                document.outcomes[sibling.line] = run_shell(sibling, document.directory, doc_home)
        earlier_failures = [
            o.command.id for line, o in sorted(document.outcomes.items()) if line < command.line and o.returncode != 0
        ]
        return document.outcomes[command.line], earlier_failures

    return run_through


# One scheduling group per document (tests/conftest.py's FINER_GROUPS, by the id ``<doc>:<line>``;
# ``make test`` distributes groups over its workers): a document's commands share its directory.
@pytest.mark.parametrize("command", COMMANDS, ids=[c.id for c in COMMANDS])
def test_doc_command(command: DocCommand, document_runs):
    reason = skip_reason(command)
    if reason:
        pytest.skip(reason)
    outcome, earlier_failures = document_runs(command)
    if outcome.returncode != 0:
        pytest.fail(outcome.report(earlier_failures), pytrace=False)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_doc_python_snippet(snippet: DocSnippet, tmp_path, doc_home):
    if snippet.needs:
        pytest.skip(f"needs: {snippet.needs}")
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    result = subprocess.run(
        [str(VENV_BIN / "python"), script.name],
        cwd=tmp_path,
        env=command_env(doc_home),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        timeout=TIMEOUT_S,
    )
    if result.returncode != 0:
        pytest.fail(
            f"{snippet.id}: exit status {result.returncode}\n--- output (tail) ---\n"
            f"{result.stdout[-OUTPUT_TAIL_CHARS:]}",
            pytrace=False,
        )


def test_the_docs_have_commands_and_snippets():
    docs = {c.doc for c in COMMANDS} | {s.doc for s in SNIPPETS}
    assert {"README.md", "docs/configuration.md", "docs/parallelism.md", "launch/README.md"} <= docs
    assert any(c.text.startswith(".venv/bin/axtorch-train") for c in COMMANDS)
    assert any(s.doc == "README.md" for s in SNIPPETS)


def test_the_training_limits_are_documented():
    assert f"`{TRAINING_LIMITS}`" in (REPO / "docs" / "testing.md").read_text()


def test_commands_split_at_lines_continuations_and_comments():
    text = [
        "# a whole-line comment",
        "axtorch-train a=1 \\",
        "    b='#not a comment' c=\"x # y\"    # a comment",
        "",
        "sbatch job.sh   # what it does  # needs: a Slurm cluster",
    ]
    block = Block("doc.md", "bash", 10, tuple(enumerate(text, start=11)))
    first, second = shell_commands(block)
    assert (first.line, first.text, first.needs) == (12, "axtorch-train a=1 b='#not a comment' c=\"x # y\"", None)
    assert (second.line, second.text, second.needs) == (15, "sbatch job.sh", "a Slurm cluster")
    assert (first.block_line, second.index) == (10, 1)


def test_training_commands_get_only_the_step_limit():
    assert as_run("make train") == "make train"
    run = as_run("PJRT_DEVICE=TPU .venv-xla/bin/python -m axtorch.train backend=xla")
    xla_on_cpu = "PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python -m axtorch.train backend=xla"
    assert run == f"{xla_on_cpu} {TRAINING_LIMITS}"
    assert as_run("axtorch-train model=mixtral_tiny") == f"axtorch-train model=mixtral_tiny {TRAINING_LIMITS}"
    assert as_run("launch/torchrun_single_node.sh model=llama3_1b").endswith(f"model=llama3_1b {TRAINING_LIMITS}")
    assert as_run("axtorch-generate checkpoint=runs/x") == "axtorch-generate checkpoint=runs/x"
    with pytest.raises(ValueError, match="compound"):
        as_run("axtorch-train x=1 | tee log")


def test_commands_that_run_torch_xla_get_its_environment():
    assert uses_xla("PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python -m axtorch.train backend=xla")
    assert uses_xla("axtorch-train dry_run=true backend=xla mesh.fsdp=-1 hardware=tpu-v5p-128")  # devices of its own
    assert not uses_xla("axtorch-train dry_run=true backend=native mesh.fsdp=-1 hardware=tpu-v5p-128")
    assert not uses_xla("axtorch-plan backend=xla mesh.fsdp=4")  # plans without torch_xla
