"""Opening a shard by path or URL, with retries and a bounded read-ahead: ``open_url``, ``ReadError``.

Every reader of this package reads its shard through ``open_url``, so local paths,
``s3://``, ``gs://``, ``http(s)://`` and any other protocol ``fsspec`` knows work alike.
What it adds to ``fsspec``:

- **Retries.** A read that raises (a dropped connection, a 5xx, a timeout) is retried on a
  freshly opened file, seeked back to the byte where the read started, up to ``retries``
  more times with an exponential backoff; each retry is logged (logger
  ``procpipe.readers``, level WARNING). When they are spent, ``ReadError`` names the URL,
  the byte offset and the last error. Errors that no retry can fix (no such file, no
  permission) are raised at once.
- **A bounded read-ahead.** A reader reads its shard through a buffer of ``read_ahead``
  bytes (``Reader.open``): on a remote file each refill is one ranged request of that
  size, ahead of the records being parsed, and no more is held per open shard (a
  ``Shards`` worker keeps a few shards open, so its memory is ``read_ahead`` times that).

fsspec is imported when a shard is first opened (in the worker), never by ``import procpipe``.
"""

from __future__ import annotations

import io
import logging
import time
from typing import Any

log = logging.getLogger("procpipe.readers")

DEFAULT_READ_AHEAD = 4 << 20  # bytes fetched ahead per open remote shard
DEFAULT_RETRIES = 3
_BACKOFF_S = 0.1  # first wait between attempts; doubled each time, at most _BACKOFF_MAX_S
_BACKOFF_MAX_S = 5.0
_FATAL = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


class ReadError(OSError):
    """A shard could not be read: every attempt failed, or its bytes are corrupt.

    The message names the shard's URL and the byte offset; ``url`` and ``offset`` hold them.
    """

    def __init__(self, message: str, url: str = "", offset: int | None = None) -> None:
        super().__init__(message)
        self.url = url
        self.offset = offset

    def __reduce__(self) -> tuple:  # re-raised in the loader's process with its fields
        return ReadError, (self.args[0], self.url, self.offset)


def check_reader_options(retries: int, read_ahead: int) -> None:
    """The options every reader shares, checked where the reader is built (not in a worker)."""
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an int >= 0 (extra attempts per failed read), got {retries!r}")
    if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 1:
        raise ValueError(f"read_ahead must be an int >= 1 (bytes fetched ahead per open shard), got {read_ahead!r}")


def open_url(
    url: Any,
    *,
    retries: int = DEFAULT_RETRIES,
    read_ahead: int = DEFAULT_READ_AHEAD,
    storage_options: dict | None = None,
) -> RetryingFile:
    """``url`` (a path, ``os.PathLike`` or a URL fsspec knows) opened for binary reading, with retries."""
    return RetryingFile(str(url) if not isinstance(url, str) else url, retries, read_ahead, dict(storage_options or {}))


class RetryingFile(io.RawIOBase):
    """A read-only, seekable binary file over fsspec that reopens itself when a read fails.

    Its position is its own (``tell``): after a failure the new file is seeked there, so a
    retried read returns the bytes the failed one would have.
    """

    def __init__(self, url: str, retries: int, read_ahead: int, storage_options: dict) -> None:
        super().__init__()
        self.url = url
        self.retries = retries
        self.read_ahead = read_ahead
        self.storage_options = storage_options
        self.retried = 0  # reads that needed another attempt (for tests and logs)
        self._pos = 0
        self._file: Any = None
        self._fs: Any = None
        self._path = ""
        self._attempt(self._open, "opening")

    # ------------------------------------------------------------------ io.RawIOBase
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            target = offset
        elif whence == io.SEEK_CUR:
            target = self._pos + offset
        elif whence == io.SEEK_END:
            target = self.size() + offset
        else:
            raise ValueError(f"invalid whence {whence!r}")
        if target < 0:
            raise ValueError(f"negative seek position {target} in {self.url}")
        self._pos = target
        if self._file is not None:
            try:
                self._file.seek(target)
            except Exception:  # noqa: BLE001 - a broken file, whatever the error: the next read reopens it
                self._drop()
        return target

    def size(self) -> int:
        """The file's length in bytes."""
        return self._attempt(lambda: self._fs.size(self._path), "asking the size of")

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        n = len(data)
        memoryview(buffer).cast("B")[:n] = data
        return n

    def read(self, size: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError(f"read from a closed file ({self.url})")

        def once() -> bytes:
            if self._file is None:
                self._open()
            data = self._file.read() if size is None or size < 0 else self._file.read(size)
            return bytes(data)

        data = self._attempt(once, "reading")
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def close(self) -> None:
        if not self.closed:
            self._drop()
        super().close()

    # ------------------------------------------------------------------ retries
    def _open(self) -> None:
        if self._fs is None:
            import fsspec  # here, in the process that reads (never at import time)

            self._fs, self._path = fsspec.core.url_to_fs(self.url, **self.storage_options)
        kwargs: dict[str, Any] = {}
        if "local" not in _protocols(self._fs):
            # No cache of fsspec's: the buffered reader above (``Reader.open``) asks for read_ahead
            # bytes at a time, each one request; fsspec's "readahead" cache would fetch as much again.
            kwargs = {"block_size": self.read_ahead, "cache_type": "none"}
        file = self._fs.open(self._path, "rb", **kwargs)
        if self._pos:
            file.seek(self._pos)
        self._file = file

    def _drop(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except Exception:  # noqa: BLE001, S110 - dropping a broken file: its close may fail in any way
                pass

    def _attempt(self, action: Any, what: str) -> Any:
        """``action()``, again on a reopened file when it raises, ``retries`` times at most."""
        wait = _BACKOFF_S
        for attempt in range(self.retries + 1):
            try:
                return action()
            except _FATAL:
                self._drop()
                raise
            except Exception as exc:
                self._drop()
                if attempt == self.retries:
                    raise ReadError(
                        f"procpipe.readers: {what} {self.url} at byte {self._pos} failed {attempt + 1} times "
                        f"(retries={self.retries}); last error: {type(exc).__name__}: {exc}. Check that the "
                        "storage is reachable, or raise retries= for a flaky connection.",
                        self.url,
                        self._pos,
                    ) from exc
                self.retried += 1
                log.warning(
                    "procpipe.readers: %s %s at byte %d failed (%s: %s); attempt %d of %d in %.1f s",
                    what,
                    self.url,
                    self._pos,
                    type(exc).__name__,
                    exc,
                    attempt + 2,
                    self.retries + 1,
                    wait,
                )
                time.sleep(wait)  # backoff between attempts at a remote store (not synchronization)
                wait = min(2 * wait, _BACKOFF_MAX_S)
        raise AssertionError("unreachable")


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


class Reader:
    """What every reader of this package shares: an ``open_fn`` for ``procpipe.Shards``.

    Calling it with a shard (a path or URL) returns an iterator over the shard's records,
    opened through ``open_url`` (retries, bounded read-ahead). A reader is a small
    picklable object: it is shipped to the workers with the ``Shards``, and opens its
    files there. Subclasses implement ``records(file, url)``.
    """

    def __init__(
        self,
        *,
        retries: int = DEFAULT_RETRIES,
        read_ahead: int = DEFAULT_READ_AHEAD,
        storage_options: dict | None = None,
    ) -> None:
        check_reader_options(retries, read_ahead)
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(
                f"storage_options must be a dict (fsspec's options for the protocol), "
                f"got {type(storage_options).__name__}"
            )
        self.retries = retries
        self.read_ahead = read_ahead
        self.storage_options = dict(storage_options or {})

    def open(self, url: Any) -> io.BufferedReader:
        """``url`` opened for reading (buffered, seekable, retrying)."""
        raw = open_url(url, retries=self.retries, read_ahead=self.read_ahead, storage_options=self.storage_options)
        return io.BufferedReader(raw, self.read_ahead)

    def __call__(self, shard: Any) -> Any:
        return self._generate(shard)

    def _generate(self, shard: Any) -> Any:
        file = self.open(shard)
        try:
            yield from self.records(file, str(shard))
        finally:
            file.close()

    def records(self, file: io.BufferedReader, url: str) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"procpipe.readers.{type(self).__name__}(retries={self.retries}, read_ahead={self.read_ahead})"
