"""TFRecord files: ``TFRecord``, the reader, and ``frame`` / ``masked_crc``, the framing.

A TFRecord file is a sequence of records, each framed as (all little-endian)::

    uint64 length
    uint32 masked_crc32c(length's 8 bytes)
    byte   data[length]
    uint32 masked_crc32c(data)

where ``masked_crc(x) = ((crc >> 15) | (crc << 17)) + 0xa282ead8`` (mod 2**32) and
``crc`` is CRC-32C (Castagnoli), computed by the ``google-crc32c`` package (C, with a pure
Python fallback of its own). Both checksums are checked: a corrupt or truncated record
is a ``ReadError`` naming the file and the record's byte offset.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from typing import Any

from .io import DEFAULT_READ_AHEAD, DEFAULT_RETRIES, Reader, ReadError

_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")


def _crc32c() -> Any:
    try:
        import google_crc32c
    except ImportError:
        raise ImportError(
            "procpipe.readers.tfrecord needs the google-crc32c package to check records: "
            "pip install 'procpipe[readers]' (or pip install google-crc32c)"
        ) from None
    return google_crc32c.value


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C of ``data``."""
    crc = _crc32c()(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(record: bytes) -> bytes:
    """``record`` framed as one TFRecord (header, data, footer): what ``tf.io.TFRecordWriter`` writes."""
    header = struct.pack("<Q", len(record))
    return header + struct.pack("<I", masked_crc(header)) + record + struct.pack("<I", masked_crc(record))


class TFRecord(Reader):
    """``open_fn`` for TFRecord shards: yields each record's bytes, checksums checked.

    Args:
        parse: ``True`` parses each record as a ``tf.train.Example`` into a dict of numpy
            arrays (``procpipe.readers.parse_example``; needs the ``protobuf`` package);
            default ``False``: the raw bytes (parse them in ``fn``).
        check_crc: ``False`` skips the data checksum (the length's is always checked).
        retries, read_ahead, storage_options: see ``procpipe.readers.open_url``.
    """

    def __init__(
        self,
        *,
        parse: bool = False,
        check_crc: bool = True,
        retries: int = DEFAULT_RETRIES,
        read_ahead: int = DEFAULT_READ_AHEAD,
        storage_options: dict | None = None,
    ) -> None:
        super().__init__(retries=retries, read_ahead=read_ahead, storage_options=storage_options)
        self.parse = bool(parse)
        self.check_crc = bool(check_crc)
        _crc32c()  # missing package: said here, where the reader is built
        if self.parse:
            from .example import example_class

            example_class()

    def records(self, file: io.BufferedReader, url: str) -> Any:
        crc = _crc32c()
        parse: Callable[[bytes], dict[str, Any]] | None = None
        if self.parse:
            from .example import parse_example as parse
        unpack_header, unpack_footer, check = _HEADER.unpack, _FOOTER.unpack, self.check_crc
        read, offset, number = file.read, 0, 0
        while True:
            header = read(12)
            if not header:
                return
            if len(header) < 12:
                raise _corrupt(url, offset, number, f"truncated header ({len(header)} of 12 bytes)")
            length, length_crc = unpack_header(header)
            if _mask(crc(header[:8])) != length_crc:
                raise _corrupt(url, offset, number, "the length's checksum does not match")
            data = read(length)
            footer = read(4)
            if len(data) < length or len(footer) < 4:
                raise _corrupt(url, offset, number, f"truncated record ({len(data)} of {length} bytes)")
            if check and _mask(crc(data)) != unpack_footer(footer)[0]:
                raise _corrupt(url, offset, number, "the data's checksum does not match")
            if parse is None:
                yield data
            else:
                try:
                    parsed = parse(data)
                except ValueError as exc:
                    raise _corrupt(url, offset, number, str(exc)) from None
                yield parsed
            offset += 16 + length
            number += 1


def _mask(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _corrupt(url: str, offset: int, number: int, what: str) -> ReadError:
    return ReadError(
        f"procpipe.readers.tfrecord: corrupt record {number} at byte {offset} of {url}: {what}. "
        "The file is damaged or not a TFRecord file (a compressed one must be decompressed first).",
        url,
        offset,
    )


def tfrecord(
    *,
    parse: bool = False,
    check_crc: bool = True,
    retries: int = DEFAULT_RETRIES,
    read_ahead: int = DEFAULT_READ_AHEAD,
    storage_options: dict | None = None,
) -> TFRecord:
    """An ``open_fn`` for ``Shards`` over TFRecord files (see ``TFRecord``)."""
    return TFRecord(
        parse=parse, check_crc=check_crc, retries=retries, read_ahead=read_ahead, storage_options=storage_options
    )
