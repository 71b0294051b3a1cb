"""JSON Lines files: ``Jsonl``, one JSON value per line."""

from __future__ import annotations

import io
import json
from typing import Any

from .io import DEFAULT_READ_AHEAD, DEFAULT_RETRIES, Reader, ReadError


class Jsonl(Reader):
    """``open_fn`` for JSON Lines shards: yields ``json.loads`` of each non-blank line.

    A line that is not valid JSON is a ``ReadError`` naming the file and the line number.
    Text is UTF-8 (a byte-order mark is refused by ``json``). Blank lines (only whitespace) are passed
    over, every time alike, so a shard's record count is its number of non-blank lines.
    """

    def records(self, file: io.BufferedReader, url: str) -> Any:
        loads = json.loads
        text = io.TextIOWrapper(file, encoding="utf-8", newline="\n")
        for number, line in enumerate(text, 1):
            try:
                value = loads(line)
            except ValueError as exc:
                if not line.strip():
                    continue
                raise ReadError(
                    f"procpipe.readers.jsonl: line {number} of {url} is not valid JSON: {exc}", url
                ) from None
            yield value


def jsonl(
    *, retries: int = DEFAULT_RETRIES, read_ahead: int = DEFAULT_READ_AHEAD, storage_options: dict | None = None
) -> Jsonl:
    """An ``open_fn`` for ``Shards`` over JSON Lines files (see ``Jsonl``)."""
    return Jsonl(retries=retries, read_ahead=read_ahead, storage_options=storage_options)
