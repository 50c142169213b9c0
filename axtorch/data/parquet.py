"""Parquet files as a document source: one string column, read one row group at a time (needs ``pyarrow``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING

from axtorch.config.errors import ConfigError
from axtorch.data.sources import (
    ROW_READERS,
    PartitionedSource,
    RowFiles,
    SourceConfig,
    resolve_globs,
)


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet
    except ImportError as error:
        raise ImportError("data.source is Parquet but `pyarrow` is not installed; run `pip install pyarrow`") from error
    return pyarrow.parquet


class ParquetSource(PartitionedSource):
    """Each row's ``text_field`` is one document, files in sorted order, rows in file order.

    Part ``p`` of ``P`` owns the row groups whose index (counted over all files) is ``p`` modulo
    ``P``. A position counts the part's rows; a resume skips whole row groups by their metadata
    and reads only the group it stopped in. Memory is one row group's column, whatever the corpus.
    """

    def __init__(self, rows: RowFiles):
        parquet = _pyarrow_parquet()
        self.rows = rows
        #: (file, row group in it, rows) of every row group, in order.
        self.row_groups: list[tuple[Path, int, int]] = []
        for path in rows.files:
            metadata = parquet.ParquetFile(path).metadata
            columns = metadata.schema.to_arrow_schema().names  # top-level: a column of messages is nested
            if rows.field not in columns:
                raise ConfigError(rows.field_key, rows.field, f"a column of {path}: {columns}")
            self.row_groups += [
                (path, group, metadata.row_group(group).num_rows) for group in range(metadata.num_row_groups)
            ]

    def read_part(self, part: int, parts: int, position: int) -> Iterator[tuple[str, int]]:
        parquet = _pyarrow_parquet()
        consumed = 0
        for path, group, rows in self.row_groups[part::parts]:
            if consumed + rows <= position:
                consumed += rows
                continue
            texts = parquet.ParquetFile(path).read_row_group(group, columns=[self.rows.field]).column(0).to_pylist()
            for offset in range(max(position - consumed, 0), rows):
                where = f"{path}: row group {group}, row {offset}"
                yield self.rows.document(texts[offset], where), consumed + offset + 1
            consumed += rows

    def fingerprint(self) -> str:
        return self.rows.fingerprint("parquet")


ROW_READERS[".parquet"] = ParquetSource


@dataclass
class ParquetSourceConfig(SourceConfig):
    """Parquet files given by globs, one document per row; ``streaming``: read while training."""

    paths: list[str] = MISSING
    text_field: str = "text"
    streaming: bool = False

    def build(self) -> ParquetSource:
        return ParquetSource(RowFiles(resolve_globs(self.paths, "data.source.paths"), self.text_field))

    def build_streaming(self) -> Optional[ParquetSource]:
        return self.build() if self.streaming else None
