"""Document sources: where training text comes from, in a fixed order, with a fingerprint for caching.

Every source yields whole documents (one string each) in a deterministic order, because the
packed token arrays follow it (the train/validation split is keyed by each document's text,
``axtorch.data.held_out``, whatever the order). The fingerprint
changes whenever the documents may have changed, so cached tokens are never reused for a new corpus.
A ``PartitionedSource`` can also be read in disjoint parts, each from a saved position, which is
what streaming (``axtorch.data.streaming``) needs: every data-parallel rank reads only its parts,
and a resume seeks instead of reading again.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from omegaconf import MISSING

from axtorch.config.errors import ConfigError
from axtorch.data.document_tokens import flag_document
from axtorch.data.files import stable_hash

if TYPE_CHECKING:
    from axtorch.data.tokenizer import Tokenizer

_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib"})


# Cache helpers: the fingerprints start here, and the tokenizer and packing caches both write files.


class DocumentSource(ABC):
    """A corpus as an ordered stream of documents."""

    @abstractmethod
    def iter_documents(self) -> Iterator[str]:
        """Yield every document, always in the same order."""

    @abstractmethod
    def fingerprint(self) -> str:
        """A stable hash that changes whenever the yielded documents may change."""


class PartitionedSource(DocumentSource):
    """A corpus readable as ``parts`` disjoint parts, each resumable from an integer position.

    The parts of one ``parts`` count together hold every document once. A position is how far
    into its part a reader got (bytes, rows or documents, as the source counts them); 0 is the
    part's start, and reading from a saved position yields exactly the documents that followed it.
    """

    @abstractmethod
    def read_part(self, part: int, parts: int, position: int) -> Iterator[tuple[str, int]]:
        """Part ``part`` of ``parts``'s documents after ``position``, each with the position just after it."""

    def iter_documents(self) -> Iterator[str]:
        for text, _ in self.read_part(0, 1, 0):
            yield text

    def encode_documents(self, documents: list[str], tokenizer: Tokenizer, mark_starts: bool) -> list[np.ndarray]:
        """Each document's tokens as streaming packs them (``document_tokens``): BOS if the model's
        tokenizer adds one, its text's ids, then EOS (``Tokenizer.document_ids``), every token a
        target; ``mark_starts``: ``DOCUMENT_START`` on the first."""
        return [flag_document(ids, mark_start=mark_starts) for ids in tokenizer.document_ids(documents)]


def require_text(value: Any, field: str, where: str) -> str:
    """A row's ``field`` as one document: it must be a string."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} is {type(value).__name__}, not a string")
    return value


#: How a row's field becomes one document (``require_text``, or a chat's messages as JSON).
FieldToDocument = Callable[[Any, str, str], str]


@dataclass(frozen=True)
class RowFiles:
    """What a reader of files of rows (``JsonlSource``, ``ParquetSource``) reads: the files in order,
    and how each row's ``field`` (config key ``field_key``, named in errors) becomes one document."""

    files: list[Path]
    field: str
    document_of: FieldToDocument = require_text
    field_key: str = "data.source.text_field"

    def document(self, value: Any, where: str) -> str:
        return self.document_of(value, self.field, where)

    def fingerprint(self, kind: str) -> str:
        return files_fingerprint(kind, self.files, text_field=self.field)


@dataclass
class SourceConfig:
    """Marker base for the polymorphic ``data.source`` slot; each subclass builds one kind of source."""

    def build(self) -> DocumentSource:
        raise NotImplementedError(f"{type(self).__name__} does not define build()")

    def pretokenized(self) -> Optional[Path]:
        """A directory of token shards that replaces tokenizing (``axtorch.data.shards``); None for documents."""
        return None

    def build_streaming(self) -> Optional[PartitionedSource]:
        """The source to read lazily while training (``streaming=true``); None: tokenize it whole, up front."""
        return None


def _read_text(path: Path) -> str:
    # A stray non-UTF-8 byte in one file of a large corpus should not abort tokenization.
    return path.read_text(encoding="utf-8", errors="replace")


def files_fingerprint(kind: str, files: list[Path], **settings: Any) -> str:
    """Hash of path, size and mtime of every file: cheap to compute, and any edit changes it."""
    stats = []
    for path in files:
        stat = path.stat()
        stats.append((str(path), stat.st_size, stat.st_mtime_ns))
    return stable_hash(kind, settings, stats)


def resolve_globs(patterns: list[str], key: str) -> list[Path]:
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
        return files_fingerprint("python-stdlib", self.files)


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
        return files_fingerprint("text-files", self.files)


@dataclass
class TextFilesSourceConfig(SourceConfig):
    """Plain text files given by globs (``**`` recursive, ``~`` expanded)."""

    paths: list[str] = MISSING

    def build(self) -> TextFilesSource:
        return TextFilesSource(resolve_globs(self.paths, "data.source.paths"))


class JsonlSource(PartitionedSource):
    """Each non-blank line of each file is a JSON object whose ``text_field`` is one document.

    Part ``p`` of ``P`` is the ``p``-th of ``P`` equal byte ranges of the files laid end to end; a
    line belongs to the range its first byte lies in, so a reader seeks to its range and reads
    nobody else's lines. A position is the bytes of the part consumed, always at a line start.
    """

    def __init__(self, rows: RowFiles):
        self.rows = rows
        self._file_starts = [0]
        for path in rows.files:
            self._file_starts.append(self._file_starts[-1] + path.stat().st_size)

    def read_part(self, part: int, parts: int, position: int) -> Iterator[tuple[str, int]]:
        total = self._file_starts[-1]
        begin, end = total * part // parts, total * (part + 1) // parts
        at = begin + position
        for index, path in enumerate(self.rows.files):
            file_start, file_end = self._file_starts[index], self._file_starts[index + 1]
            if file_end <= at or file_start == file_end:
                continue
            if file_start >= end:
                return
            with path.open("rb") as file:
                local = max(at - file_start, 0)
                if local and position == 0:  # a range's first byte may sit inside its predecessor's last line
                    file.seek(local - 1)
                    file.readline()
                    local = file.tell()
                file.seek(local)
                line_number: Optional[int] = 1 if local == 0 else None  # unknown after a seek
                line_start = file_start + local
                while line_start < end and (line := file.readline()):
                    next_start = line_start + len(line)
                    if line.strip():
                        where = f"{path}:{line_number}" if line_number else f"{path} (byte {line_start - file_start})"
                        yield self._text_of(line, where), next_start - begin
                    line_start = next_start
                    line_number = line_number + 1 if line_number else None
            at = max(at, file_end)

    def _text_of(self, line: bytes, where: str) -> str:
        try:
            record = json.loads(line.decode("utf-8", errors="replace"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg})") from error
        field = self.rows.field
        if not isinstance(record, dict) or field not in record:
            fields = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where}: no field {field!r} ({self.rows.field_key}); found {fields}")
        return self.rows.document(record[field], where)

    def fingerprint(self) -> str:
        return self.rows.fingerprint("jsonl")


@dataclass
class JsonlSourceConfig(SourceConfig):
    """JSON-lines files given by globs, one document per line; ``streaming``: read while training."""

    paths: list[str] = MISSING
    text_field: str = "text"
    streaming: bool = False

    def build(self) -> JsonlSource:
        return JsonlSource(RowFiles(resolve_globs(self.paths, "data.source.paths"), self.text_field))

    def build_streaming(self) -> Optional[JsonlSource]:
        return self.build() if self.streaming else None


#: How files of rows are read, by suffix (Parquet registers itself in ``parquet.py``); any other
#: suffix is JSON lines.
ROW_READERS: dict[str, Callable[[RowFiles], PartitionedSource]] = {}


def read_rows(files: list[Path], field: str, document_of: FieldToDocument, field_key: str) -> PartitionedSource:
    """The rows of ``files`` (all of one format, by suffix), each row's ``field`` (config key
    ``field_key``) one document."""
    readers = {ROW_READERS.get(file.suffix, JsonlSource) for file in files}
    if len(readers) > 1:
        raise ConfigError("data.source.paths", [str(file) for file in files], "files of one format (by suffix)")
    (reader,) = readers
    return reader(RowFiles(files, field, document_of, field_key))


class HFDatasetSource(PartitionedSource):
    """One column of a Hugging Face ``datasets`` split, in the dataset's row order.

    With ``streaming`` the split is an ``IterableDataset``: rows arrive as they are read, none is
    downloaded or held up front. Part ``p`` of ``P`` is ``IterableDataset.shard(P, p)`` when the
    dataset has at least ``P`` file shards (each reader opens only its files), else every ``P``-th
    row (each reader reads every row and keeps its own). A position counts the part's rows; a
    resume reads past that many rows again but tokenizes none of them.
    """

    def __init__(
        self,
        path: str,
        name: Optional[str],
        split: str,
        data_files: Optional[list[str]],
        text_field: str,
        streaming: bool = False,
    ):
        self.path = path
        self.name = name
        self.split = split
        self.data_files = None if data_files is None else [os.path.expanduser(f) for f in data_files]
        self.text_field = text_field
        self.streaming = streaming
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
            dataset = datasets.load_dataset(
                self.path, self.name, split=self.split, data_files=self.data_files, streaming=self.streaming
            )
            columns = dataset.column_names  # None for a streamed dataset whose features are unknown
            if columns is not None and self.text_field not in columns:
                raise ConfigError("data.source.text_field", self.text_field, f"a column of the dataset: {columns}")
            self._dataset = dataset
        return self._dataset

    def read_part(self, part: int, parts: int, position: int) -> Iterator[tuple[str, int]]:
        dataset = self._load()
        if parts > 1 and getattr(dataset, "num_shards", 0) >= parts:
            rows: Iterator[Any] = iter(dataset.shard(num_shards=parts, index=part))
        else:
            rows = islice(dataset, part, None, parts)
        for index, row in enumerate(islice(rows, position, None), start=position + 1):
            if self.text_field not in row:
                raise ConfigError("data.source.text_field", self.text_field, f"a column of the dataset: {sorted(row)}")
            yield row[self.text_field], index

    def fingerprint(self) -> str:
        # The arguments identify a hub dataset; local data files also contribute their stats so an
        # edited file invalidates the cache.
        local_files = sorted(
            {Path(m).absolute() for f in self.data_files or [] for m in glob.glob(f, recursive=True)},
            key=str,
        )
        return files_fingerprint(
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
    """A dataset loaded with ``datasets.load_dataset`` (hub name, or a builder such as ``json``);
    ``streaming``: as an ``IterableDataset``, read while training."""

    path: str = MISSING
    name: Optional[str] = None
    split: str = "train"
    data_files: Optional[list[str]] = None
    text_field: str = "text"
    streaming: bool = False

    def build(self) -> HFDatasetSource:
        return HFDatasetSource(self.path, self.name, self.split, self.data_files, self.text_field, self.streaming)

    def build_streaming(self) -> Optional[HFDatasetSource]:
        return self.build() if self.streaming else None
