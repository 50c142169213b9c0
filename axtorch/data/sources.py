"""Document sources: where training text comes from, in a fixed order, with a fingerprint for caching.

Every source yields whole documents (one string each) in a deterministic order, because the
train/validation split and the packed token arrays are keyed by document index. The fingerprint
changes whenever the documents may have changed, so cached tokens are never reused for a new corpus.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional

from omegaconf import MISSING

from axtorch.config.errors import ConfigError

_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib"})


# Cache helpers: the fingerprints start here, and the tokenizer and packing caches both write files.


def stable_hash(*parts: Any) -> str:
    """A short hex digest of JSON-able parts, identical across processes and Python versions."""
    payload = json.dumps(parts, sort_keys=True, default=str).encode("utf-8")
    return hashlib.sha256(payload).hexdigest()[:16]


def write_file_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through a temporary file and rename it, so ``path`` is either absent or complete.

    A run killed mid-write must not leave a truncated cache file that the next run would trust.
    """
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


class DocumentSource(ABC):
    """A corpus as an ordered stream of documents."""

    @abstractmethod
    def iter_documents(self) -> Iterator[str]:
        """Yield every document, always in the same order."""

    @abstractmethod
    def fingerprint(self) -> str:
        """A stable hash that changes whenever the yielded documents may change."""


@dataclass
class SourceConfig:
    """Marker base for the polymorphic ``data.source`` slot; each subclass builds one kind of source."""

    def build(self) -> DocumentSource:
        raise NotImplementedError(f"{type(self).__name__} does not define build()")

    def pretokenized(self) -> Optional[Path]:
        """A directory of token shards that replaces tokenizing (``axtorch.data.shards``); None for documents."""
        return None


def _read_text(path: Path) -> str:
    # A stray non-UTF-8 byte in one file of a large corpus should not abort tokenization.
    return path.read_text(encoding="utf-8", errors="replace")


def _files_fingerprint(kind: str, files: list[Path], **settings: Any) -> str:
    """Hash of path, size and mtime of every file: cheap to compute, and any edit changes it."""
    stats = []
    for path in files:
        stat = path.stat()
        stats.append((str(path), stat.st_size, stat.st_mtime_ns))
    return stable_hash(kind, settings, stats)


def _resolve_globs(patterns: list[str], key: str) -> list[Path]:
    """Expand ``~`` and (recursive) globs into a sorted, deduplicated list of files.

    A pattern that matches no file is a ConfigError on ``key``: a typo in a path should fail
    before any work, not silently train on less data.
    """
    if not patterns:
        raise ConfigError(key, patterns, "a non-empty list of file globs")
    files: set[Path] = set()
    for pattern in patterns:
        matches = [
            Path(match).absolute()
            for match in glob.glob(os.path.expanduser(pattern), recursive=True)
            if os.path.isfile(match)
        ]
        if not matches:
            raise ConfigError(key, pattern, "globs that each match at least one file", "matches no file")
        files.update(matches)
    return sorted(files, key=str)


class PythonStdlibSource(DocumentSource):
    """The ``*.py`` files of the running Python's standard library: a corpus every machine has."""

    def __init__(self, max_files: Optional[int] = None):
        files: list[Path] = []
        for directory, subdirectories, names in os.walk(sysconfig.get_paths()["stdlib"]):
            # Pruning in place keeps the walk out of site-packages and the large test trees.
            subdirectories[:] = [name for name in subdirectories if name not in _STDLIB_EXCLUDED_DIRS]
            files.extend(Path(directory, name) for name in names if name.endswith(".py"))
        files.sort(key=str)
        self.files = files if max_files is None else files[:max_files]

    def iter_documents(self) -> Iterator[str]:
        for path in self.files:
            yield _read_text(path)

    def fingerprint(self) -> str:
        return _files_fingerprint("python-stdlib", self.files)


@dataclass
class PythonStdlibSourceConfig(SourceConfig):
    """The embedded default corpus (about 670 files, 11 MB on Python 3.11)."""

    max_files: Optional[int] = None

    def build(self) -> PythonStdlibSource:
        if self.max_files is not None and self.max_files < 1:
            raise ConfigError("data.source.max_files", self.max_files, "null or an integer >= 1")
        return PythonStdlibSource(self.max_files)


class TextFilesSource(DocumentSource):
    """Each file is one document."""

    def __init__(self, files: list[Path]):
        self.files = files

    def iter_documents(self) -> Iterator[str]:
        for path in self.files:
            yield _read_text(path)

    def fingerprint(self) -> str:
        return _files_fingerprint("text-files", self.files)


@dataclass
class TextFilesSourceConfig(SourceConfig):
    """Plain text files given by globs (``**`` recursive, ``~`` expanded)."""

    paths: list[str] = MISSING

    def build(self) -> TextFilesSource:
        return TextFilesSource(_resolve_globs(self.paths, "data.source.paths"))


class JsonlSource(DocumentSource):
    """Each non-blank line of each file is a JSON object whose ``text_field`` is one document."""

    def __init__(self, files: list[Path], text_field: str):
        self.files = files
        self.text_field = text_field

    def iter_documents(self) -> Iterator[str]:
        for path in self.files:
            with path.open(encoding="utf-8", errors="replace") as lines:
                for line_number, line in enumerate(lines, start=1):
                    if line.strip():
                        yield self._text_of(line, f"{path}:{line_number}")

    def _text_of(self, line: str, where: str) -> str:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg})") from error
        if not isinstance(record, dict) or self.text_field not in record:
            fields = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where}: no field {self.text_field!r} (data.source.text_field); found {fields}")
        text = record[self.text_field]
        if not isinstance(text, str):
            raise ValueError(f"{where}: field {self.text_field!r} is {type(text).__name__}, not a string")
        return text

    def fingerprint(self) -> str:
        return _files_fingerprint("jsonl", self.files, text_field=self.text_field)


@dataclass
class JsonlSourceConfig(SourceConfig):
    """JSON-lines files given by globs, one document per line."""

    paths: list[str] = MISSING
    text_field: str = "text"

    def build(self) -> JsonlSource:
        return JsonlSource(_resolve_globs(self.paths, "data.source.paths"), self.text_field)


class HFDatasetSource(DocumentSource):
    """One column of a Hugging Face ``datasets`` split, in the dataset's row order."""

    def __init__(
        self,
        path: str,
        name: Optional[str],
        split: str,
        data_files: Optional[list[str]],
        text_field: str,
    ):
        self.path = path
        self.name = name
        self.split = split
        self.data_files = None if data_files is None else [os.path.expanduser(f) for f in data_files]
        self.text_field = text_field
        self._dataset: Any = None

    def _load(self) -> Any:
        if self._dataset is None:
            try:
                import datasets
            except ImportError as error:
                raise ImportError(
                    "data.source is an HF dataset but the `datasets` package is not installed; "
                    "run `pip install datasets` or install axtorch with the `hf` extra"
                ) from error
            dataset = datasets.load_dataset(self.path, self.name, split=self.split, data_files=self.data_files)
            if self.text_field not in dataset.column_names:
                raise ConfigError(
                    "data.source.text_field",
                    self.text_field,
                    f"a column of the dataset: {dataset.column_names}",
                )
            self._dataset = dataset
        return self._dataset

    def iter_documents(self) -> Iterator[str]:
        for row in self._load():
            yield row[self.text_field]

    def fingerprint(self) -> str:
        # The arguments identify a hub dataset; local data files also contribute their stats so an
        # edited file invalidates the cache.
        local_files = sorted(
            {Path(m).absolute() for f in self.data_files or [] for m in glob.glob(f, recursive=True)},
            key=str,
        )
        return _files_fingerprint(
            "hf-dataset",
            [f for f in local_files if f.is_file()],
            path=self.path,
            name=self.name,
            split=self.split,
            data_files=self.data_files,
            text_field=self.text_field,
        )


@dataclass
class HFDatasetSourceConfig(SourceConfig):
    """A dataset loaded with ``datasets.load_dataset`` (hub name, or a builder such as ``json``)."""

    path: str = MISSING
    name: Optional[str] = None
    split: str = "train"
    data_files: Optional[list[str]] = None
    text_field: str = "text"

    def build(self) -> HFDatasetSource:
        return HFDatasetSource(self.path, self.name, self.split, self.data_files, self.text_field)
