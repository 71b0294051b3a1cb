"""JSON Lines files: ``Jsonl``, one JSON value per line."""
from __future__ import annotations

import io
import json
from typing import Any

from .io import DEFAULT_READ_AHEAD, DEFAULT_RETRIES, ReadError, Reader


class Jsonl(Reader):
    """``open_fn`` for JSON Lines shards: yields ``json.loads`` of each non-blank line.

    A line that is not valid JSON is a ``ReadError`` naming the file, the line number and
    its byte offset. Blank lines (only whitespace) are passed over, every time alike, so a
    shard's record count is its number of non-blank lines.
    """

    def records(self, file: io.BufferedReader, url: str) -> Any:
        loads, offset = json.loads, 0
        for number, line in enumerate(file, 1):
            if line.strip():
                try:
                    value = loads(line)
                except ValueError as exc:
                    raise ReadError(f"procpipe.readers.jsonl: line {number} (byte {offset}) of {url} is not "
                                    f"valid JSON: {exc}", url, offset) from None
                yield value
            offset += len(line)


def jsonl(*, retries: int = DEFAULT_RETRIES, read_ahead: int = DEFAULT_READ_AHEAD,
          storage_options: dict | None = None) -> Jsonl:
    """An ``open_fn`` for ``Shards`` over JSON Lines files (see ``Jsonl``)."""
    return Jsonl(retries=retries, read_ahead=read_ahead, storage_options=storage_options)
