"""WebDataset tar shards: ``WebDataset``, tar members grouped into samples by key."""

from __future__ import annotations

import io
import posixpath
import tarfile
from typing import Any

from .io import DEFAULT_READ_AHEAD, DEFAULT_RETRIES, Reader, ReadError


def split_key(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member name, as WebDataset splits it: the key is the path up
    to the first dot of the file name (``a/b.seg.png`` -> ``("a/b", "seg.png")``)."""
    directory, base = posixpath.split(name)
    stem, _, extension = base.partition(".")
    return posixpath.join(directory, stem) if directory else stem, extension


class WebDataset(Reader):
    """``open_fn`` for WebDataset shards (tar files): yields one dict per sample.

    Consecutive members with the same key (``split_key``) form a sample:
    ``{"__key__": key, "__url__": shard, extension: bytes, ...}``, as the ``webdataset``
    package gives them before decoding (decode in ``fn``). The tar is read as a stream
    (``tarfile`` mode ``"r|*"``, gzip-compressed too), never seeked. Members that are not
    regular files, and names starting with ``__`` or ``.`` (metadata), are passed over.
    A damaged tar is a ``ReadError`` naming the shard and the byte offset reached.
    """

    def records(self, file: io.BufferedReader, url: str) -> Any:
        sample: dict[str, Any] | None = None
        try:
            with tarfile.open(fileobj=file, mode="r|*") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    key, extension = split_key(member.name)
                    base = posixpath.basename(member.name)
                    if base.startswith(("__", ".")) or not extension:
                        continue
                    extracted = tar.extractfile(member)
                    if extracted is None:  # (a regular file always has its bytes)
                        continue
                    data = extracted.read()
                    if sample is not None and sample["__key__"] != key:
                        yield sample
                        sample = None
                    if sample is None:
                        sample = {"__key__": key, "__url__": url}
                    if extension in sample:
                        raise ReadError(
                            f"procpipe.readers.webdataset: {url} holds two members named {member.name!r} "
                            f"in one sample; a WebDataset shard has one member per key and extension",
                            url,
                            member.offset,
                        )
                    sample[extension] = data
        except tarfile.TarError as exc:
            raise ReadError(
                f"procpipe.readers.webdataset: {url} is not a readable tar file (near byte {file.tell()}): {exc}",
                url,
                file.tell(),
            ) from None
        if sample is not None:
            yield sample


def webdataset(
    *, retries: int = DEFAULT_RETRIES, read_ahead: int = DEFAULT_READ_AHEAD, storage_options: dict | None = None
) -> WebDataset:
    """An ``open_fn`` for ``Shards`` over WebDataset tar shards (see ``WebDataset``)."""
    return WebDataset(retries=retries, read_ahead=read_ahead, storage_options=storage_options)
