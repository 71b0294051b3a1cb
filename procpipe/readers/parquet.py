"""Parquet files: ``Parquet``, rows read one row group at a time through pyarrow."""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import Any

from .io import DEFAULT_READ_AHEAD, DEFAULT_RETRIES, Reader


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            "procpipe.readers.parquet needs pyarrow: pip install 'procpipe[readers]' (or pip install pyarrow)"
        ) from None
    return pq


class Parquet(Reader):
    """``open_fn`` for Parquet shards: yields one dict per row, ``{column: value}``.

    The file is read one row group at a time (``pyarrow.parquet.ParquetFile.read_row_group``),
    so memory holds one row group, not the file; values are Python objects
    (``pyarrow``'s ``to_pylist``: ints, floats, str, bytes, lists).

    Args:
        columns: the columns to read (default: all).
        retries, read_ahead, storage_options: see ``procpipe.readers.open_url``.
    """

    def __init__(
        self,
        *,
        columns: Sequence[str] | None = None,
        retries: int = DEFAULT_RETRIES,
        read_ahead: int = DEFAULT_READ_AHEAD,
        storage_options: dict | None = None,
    ) -> None:
        super().__init__(retries=retries, read_ahead=read_ahead, storage_options=storage_options)
        if isinstance(columns, str):
            raise TypeError(f"columns must be a list of column names, got the string {columns!r}; write [{columns!r}]")
        self.columns = None if columns is None else list(columns)
        _pyarrow_parquet()

    def records(self, file: io.BufferedReader, url: str) -> Any:
        parquet = _pyarrow_parquet().ParquetFile(file)
        for group in range(parquet.num_row_groups):
            table = parquet.read_row_group(group, columns=self.columns)
            names = table.column_names
            columns = [table.column(name).to_pylist() for name in names]
            del table
            for row in zip(*columns, strict=True):
                yield dict(zip(names, row, strict=True))

    def lengths(self, shards: Iterable[Any]) -> list[int]:
        """The rows of each shard, from the files' footers (for ``Shards(lengths=...)``)."""
        pq, counts = _pyarrow_parquet(), []
        for shard in shards:
            with self.open(shard) as file:
                counts.append(pq.ParquetFile(file).metadata.num_rows)
        return counts


def parquet(
    *,
    columns: Sequence[str] | None = None,
    retries: int = DEFAULT_RETRIES,
    read_ahead: int = DEFAULT_READ_AHEAD,
    storage_options: dict | None = None,
) -> Parquet:
    """An ``open_fn`` for ``Shards`` over Parquet files (see ``Parquet``)."""
    return Parquet(columns=columns, retries=retries, read_ahead=read_ahead, storage_options=storage_options)
