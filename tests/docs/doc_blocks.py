"""The shell commands and Python snippets of the documentation, and how the tests run them.

``test_doc_commands.py`` runs every command of every fenced ```` ```bash ```` block and every
```` ```python ```` snippet found here; docs/testing.md is the user-facing description. The parts:

- extraction: fenced blocks, commands split at unescaped line ends (``\\`` continues a line),
  comments (``# ...`` outside quotes) removed, and the ``# needs: <what>`` marker read from them;
- ``as_run``: the command as the test runs it: step and evaluation limits (``TRAINING_LIMITS``)
  appended to training commands, TPU lines on CPU virtual devices, the benchmark at its smallest.
"""

from __future__ import annotations

import itertools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: The documents whose ```bash and ```python blocks are run (``launch/*/README.md`` too).
DOC_GLOBS = ("README.md", "docs/*.md", "launch/README.md", "launch/*/README.md")

#: Appended to every training command (``axtorch-train``, ``-m axtorch.train`` under python or
#: torchrun, the ``launch/*.sh`` scripts that end in it), after its own overrides so that it wins:
#: the only change to what the reader runs. The last step logs, evaluates and saves a checkpoint,
#: so the commands after it (generate, plot, export) read what they would after a full run.
#: docs/testing.md quotes this line; a test keeps the two equal.
#: Two steps, and two batches at each evaluation (the start's and the last step's) instead of the
#: trainer's 20: every training path still runs, in a third less time.
TRAINING_LIMITS = "trainer.max_steps=2 trainer.eval_batches=2"
#: Scripts run at their smallest (argparse: the last value of a repeated option wins).
SCRIPT_ARGS = {"benchmarks/train_throughput.py": "--steps 1 --repeats 1"}
#: TPU lines run on 4 CPU virtual devices, with .venv-xla first on PATH.
TPU = "PJRT_DEVICE=TPU"
TPU_ON_CPU = "PJRT_DEVICE=CPU CPU_NUM_DEVICES=4"

_HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)'?\"?\s*$")
_NEEDS = re.compile(r"(?:^|\s)#\s*needs:\s*(.+?)\s*$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Block:
    doc: str  # path relative to the repository
    lang: str
    line: int  # line number of the opening fence
    lines: tuple[tuple[int, str], ...]  # (line number, text) of the block's content


@dataclass(frozen=True)
class DocCommand:
    doc: str
    line: int  # the command's first line
    block_line: int  # the opening fence of its block
    index: int  # its position in the block
    text: str  # as written: continuations joined, comments removed
    needs: str | None  # the reason of a ``# needs: ...`` marker

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


@dataclass(frozen=True)
class DocSnippet:
    doc: str
    line: int  # the snippet's first line
    code: str
    needs: str | None  # from a first line ``# needs: ...``

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_files(repo: Path = REPO) -> list[Path]:
    files = {path for pattern in DOC_GLOBS for path in repo.glob(pattern)}
    return sorted(files, key=lambda path: path.relative_to(repo).as_posix())


def fenced_blocks(path: Path, repo: Path = REPO) -> list[Block]:
    """Every fenced block of a Markdown file, with its language (the info string's first word)."""
    doc = path.relative_to(repo).as_posix()
    blocks, lang, start, content = [], None, 0, []
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        stripped = text.strip()
        if lang is None:
            if stripped.startswith("```") and "`" not in stripped.lstrip("`"):  # CommonMark: no ` in the info
                lang, start, content = (stripped[3:].split() or [""])[0].lower(), number, []
        elif stripped == "```":
            blocks.append(Block(doc, lang, start, tuple(content)))
            lang = None
        else:
            content.append((number, text))
    if lang is not None:
        raise ValueError(f"{doc}:{start}: unclosed ``` block")
    return blocks


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of one shell line: a ``#`` outside quotes that starts a word begins the comment."""
    quote, i = None, 0
    while i < len(line):
        char = line[i]
        if quote == "'":
            quote = None if char == "'" else quote
        elif quote == '"':
            if char == "\\":
                i += 1
            elif char == '"':
                quote = None
        elif char == "\\":
            i += 1
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i:]
        i += 1
    return line, ""


def shell_commands(block: Block) -> list[DocCommand]:
    """The commands of a shell block: ``\\`` at a line's end continues it, a here-document
    (``<<'EOF'``) takes the lines up to its delimiter verbatim; comments and blank lines go."""
    commands: list[DocCommand] = []
    parts: list[str] = []
    comments: list[str] = []
    first_line = 0
    heredoc_end: str | None = None
    for number, text in block.lines:
        if heredoc_end is not None:
            parts.append(text)
            if text.strip() == heredoc_end:
                commands.append(_command(block, first_line, len(commands), "\n".join(parts), comments))
                parts, comments, heredoc_end = [], [], None
            continue
        code, comment = split_comment(text)
        if not parts and not code.strip():
            continue  # a blank or comment-only line
        if not parts:
            first_line = number
        comments.append(comment)
        code = code.rstrip()
        if code.endswith("\\") and not code.endswith("\\\\"):
            parts.append(code[:-1].strip())
            continue
        if heredoc := _HEREDOC.search(code):
            heredoc_end = heredoc.group(1)
            parts.append(" ".join(p for p in [*parts, code.strip()] if p))
            del parts[:-1]
            continue
        parts.append(code.strip())
        commands.append(_command(block, first_line, len(commands), " ".join(p for p in parts if p), comments))
        parts, comments = [], []
    if parts:
        raise ValueError(f"{block.doc}:{first_line}: the block ends inside a continued command or a here-document")
    return commands


def _command(block: Block, first_line: int, index: int, text: str, comments: list[str]) -> DocCommand:
    needs = [m.group(1) for m in map(_NEEDS.search, comments) if m]
    return DocCommand(block.doc, first_line, block.line, index, text, needs[-1] if needs else None)


def python_snippet(block: Block) -> DocSnippet:
    code_lines = [text for _, text in block.lines]
    first = next(((n, t) for n, t in block.lines if t.strip()), (block.line + 1, ""))
    match = re.match(r"\s*#\s*needs:\s*(.+?)\s*$", first[1])
    return DocSnippet(block.doc, first[0], "\n".join(code_lines) + "\n", match.group(1) if match else None)


def collect(repo: Path = REPO) -> tuple[list[DocCommand], list[DocSnippet]]:
    """Every command of the ```bash blocks and every ```python snippet of the documentation."""
    commands, snippets = [], []
    for path in doc_files(repo):
        for block in fenced_blocks(path, repo):
            if block.lang in ("bash", "sh", "shell"):
                commands += shell_commands(block)
            elif block.lang == "python":
                snippets.append(python_snippet(block))
    return commands, snippets


def _words(text: str) -> list[str]:
    """The command's words after any leading ``VAR=value`` assignments."""
    words = shlex.split(text)
    while words and _ASSIGNMENT.match(words[0]):
        words.pop(0)
    return words


def _is_compound(text: str) -> bool:
    """Whether the command has shell operators (pipes, lists, redirections) outside quotes."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return any(token and set(token) <= set("|&;<>()") for token in lexer)


def is_training_command(text: str) -> bool:
    words = _words(text)
    if not words:
        return False
    program = words[0]
    runs_module = any(a == "-m" and b == "axtorch.train" for a, b in itertools.pairwise(words))
    return (
        Path(program).name == "axtorch-train"
        or runs_module
        or re.fullmatch(r"(\./)?launch/[^/]+\.sh", program) is not None
    )


def uses_xla(text: str) -> bool:
    """Whether a command runs torch_xla: it names the XLA devices, or it is the xla backend's dry
    run, which sets up devices of its own."""
    words = _words(text)
    return "PJRT_DEVICE=" in text or ("dry_run=true" in words and "backend=xla" in words)


def as_run(text: str) -> str:
    """The command as the test runs it; unchanged but for the documented additions (docs/testing.md)."""
    run = text.replace(TPU, TPU_ON_CPU)
    if is_training_command(text):
        if _is_compound(text):
            raise ValueError(f"cannot append the training limits to a compound command: {text}")
        run = f"{run} {TRAINING_LIMITS}"
    words = _words(text)
    for script, args in SCRIPT_ARGS.items():
        if script in words:
            run = f"{run} {args}"
    return run
