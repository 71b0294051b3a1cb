"""``procpipe.Records``: dataset metadata packed column-wise into one read-only shared file.

A dataset holding a big Python list (say 1 M dicts of file names and labels) makes every
forked worker's memory grow as it reads: touching a Python object writes its reference
count, and the kernel copies the page the object lives on into that worker
(pytorch#13246). ``Records`` stores each column as a numpy array (strings and bytes as one
UTF-8 buffer plus int64 offsets) in a single file mapped read-only, and builds every
record it returns fresh, so reading touches no shared Python object.

Lifetime. The records live in anonymous shared memory (a memfd named
``procpipe-<pid>-<token>-records``: _core/shm.py), so no ``/dev/shm`` size limits them; what they
need is checked against the memory this process may still take first. They exist exactly as
long as a process has them open or mapped (the ``Records`` that made them, or workers that map
them), so nothing can be left behind, even when the owner is SIGKILLed. With ``shm_dir=`` they
are a file there instead, whose name is removed at once, before it is even filled. Other
processes reach them through ``/proc/<owner pid>/fd/<fd>``: pickling a ``Records`` sends that
address and a check of the segment's identity (about 150 bytes, whatever the size), and
unpickling maps the same pages. Forked workers inherit the mapping. ``save``/``load`` keep a
file of your own.

File format: ``MAGIC``, the JSON header's length (uint64), the JSON header, then each
column's arrays, 64-byte aligned. The header's offsets are relative to the end of the
header (rounded up to 64); a text column's offsets array holds absolute file positions.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import struct
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core.shm import aligned, new_memory, open_new_file, open_proc_address, proc_address, seal_writes

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; typing_extensions is read by type checkers only

MAGIC = b"PPRECS01"
_TEXT = ("str", "bytes")
_NUMBERS = (int, float, np.integer, np.floating)
_BOOLS = (bool, np.bool_)


class Records(Sequence):
    """A read-only list of records (dicts, tuples or scalars) in shared memory.

    Args:
        items: a non-empty list (or iterable) of dicts with the same ``str`` keys, of
            tuples of the same length, or of scalars. Each field holds one kind of value
            in every record: ``str``, ``bytes``, ``bool``, numbers (``int`` → int64, or
            uint64 if needed, never rounded; ``float`` or a mix with ``int`` → float64;
            numpy scalars keep their dtype).
            ``None``, mixed kinds, other types and inconsistent keys raise an error naming
            the record and the field.
        shm_dir: None (the default): anonymous shared memory, limited by memory only; a
            directory: an unlinked file there instead.

    ``records[i]`` builds a fresh dict (tuple, scalar) of Python values; a slice is a
    ``Records`` view of the same memory. ``column(name)`` returns a numeric column as a
    read-only numpy array (no copy), a text column as a list. Pickling sends a small
    address, not the data. ``close()`` (or the ``with`` block, or garbage collection)
    releases the memory once no worker maps it any more; it closes every view.
    """

    def __init__(self, items: Iterable[Any], *, shm_dir: str | None = None) -> None:
        if shm_dir is not None and not os.path.isdir(shm_dir):
            raise ValueError(f"shm_dir={shm_dir!r} is not a directory")
        header, parts, size = _pack(items)
        name = f"procpipe-{os.getpid()}-{secrets.token_hex(4)}-records"
        what = "procpipe.Records"
        if shm_dir is None:  # reserved at once: too little memory fails here, never later
            fd = new_memory(name, size, what, "fewer records or columns; or save them to a file, Records.load it")
        else:
            path = os.path.join(shm_dir, name)
            fd = open_new_file(path, size, what, unlinked=True)  # reserves the pages: a full tmpfs fails here
            os.unlink(path)  # from now on the file lives only while open or mapped
        try:
            _write(fd, header, parts)
            if shm_dir is None:
                seal_writes(fd)  # read-only for good: no process can change them under the others
            self._store = _Store(fd, ("proc", *proc_address(fd)), populate=True, own_fd=True)
        except BaseException:
            os.close(fd)
            raise
        self._span = range(self._store.length)

    @classmethod
    def load(cls, path: str) -> Records:
        """Map a file written by ``save`` (read-only, pages read on demand: it may exceed RAM)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            store = _Store(fd, ("path", os.path.abspath(path)), populate=False, own_fd=False)
        finally:
            os.close(fd)
        return cls._view(store, range(store.length))

    def save(self, path: str) -> None:
        """Write these records to ``path`` (atomically), for ``Records.load(path)`` later."""
        store = self._store
        store.check_open()
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if self._span == range(store.length):
                _pwrite(fd, store.map, 0)
            else:  # a view: pack its records anew
                header, parts, _ = _pack(list(self))
                _write(fd, header, parts)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)

    @classmethod
    def _view(cls, store: _Store, span: range) -> Records:
        view = cls.__new__(cls)
        view._store, view._span = store, span
        return view

    # ------------------------------------------------------------------ list-like access
    def __len__(self) -> int:
        return len(self._span)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self._view(self._store, self._span[i])
        try:
            j = self._span[i]
        except IndexError:
            raise IndexError(f"record index {i} out of range for {len(self)} records") from None
        except TypeError:
            raise TypeError(f"Records indices must be integers or slices, not {type(i).__name__}") from None
        return self._store.record(j)

    def __iter__(self) -> Iterator[Any]:
        record = self._store.record
        for j in self._span:
            yield record(j)

    @property
    def columns(self) -> tuple:
        """Field names: the dict keys, tuple positions ``0..k-1``, or ``(0,)`` for scalars."""
        return tuple(self._store.names)

    @property
    def nbytes(self) -> int:
        """Size of the shared file (all columns and the header), shared by every view."""
        return self._store.nbytes

    def column(self, name: Any) -> Any:
        """A numeric column as a read-only numpy array (a view, no copy); a text column as a list."""
        store = self._store
        getters = store.check_open()
        try:
            k = store.names.index(name)
        except ValueError:
            raise KeyError(f"no column {name!r}; the columns are {store.names}") from None
        array = store.arrays[k]
        if array is None:
            get = getters[k]
            return [get(j) for j in self._span]
        span = self._span
        return array[span.start : None if span.stop < 0 else span.stop : span.step]

    # ------------------------------------------------------------------ lifetime, pickling
    def close(self) -> None:
        """Release the memory (of this Records and every view of it); workers keep their mapping."""
        self._store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple:
        store = self._store
        store.check_open()
        span = self._span
        return _rebuild, (store.where, store.token, (span.start, span.stop, span.step))

    def __repr__(self) -> str:
        store = self._store
        if store.getters is None:
            return "<procpipe.Records, closed>"
        fields = ", ".join(
            f"{n}: {c['type'] if c['type'] in _TEXT else np.dtype(c['type'])}"
            for n, c in zip(store.names, store.header["columns"], strict=True)
        )
        return f"<procpipe.Records: {len(self)} {store.kind} records ({fields}), {store.nbytes / 2**20:.1f} MiB>"


class _Store:
    """One mapped records file: its header, column arrays and value getters."""

    def __init__(self, fd: int, where: tuple, populate: bool, own_fd: bool) -> None:
        size = os.fstat(fd).st_size
        if size < 16:
            raise ValueError(f"not a procpipe.Records file (only {size} bytes): {where[-1]}")
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self.map: mmap.mmap | None
        self.map = mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        self.where, self.nbytes = where, size
        if mm[:8] != MAGIC:
            raise ValueError(f"not a procpipe.Records file: {where[-1]}")
        (header_len,) = struct.unpack_from("<Q", mm, 8)
        self.header = header = json.loads(mm[16 : 16 + header_len])
        base = aligned(16 + header_len)
        self.token, self.kind, self.length = header["token"], header["kind"], header["length"]
        self.names = [c["name"] for c in header["columns"]]
        self.arrays: list[np.ndarray | None] = []
        self.getters: list | None = []
        for c in header["columns"]:
            if c["type"] in _TEXT:
                offsets = np.frombuffer(mm, np.int64, self.length + 1, base + c["offsets"])
                self.arrays.append(None)
                self.getters.append(_text_getter(mm, offsets.item, c["type"] == "str"))
            else:
                array = np.frombuffer(mm, np.dtype(c["type"]), self.length, base + c["offset"])
                self.arrays.append(array)
                self.getters.append(array.item)
        self.named = list(zip(self.names, self.getters, strict=True))
        # The owner keeps its descriptor open (others reach the file through it) until close or GC.
        self._close_fd = weakref.finalize(self, os.close, fd) if own_fd else None

    def record(self, j: int) -> Any:
        getters = self.getters
        if getters is None:
            raise _closed()
        if self.kind == "dict":
            return {name: get(j) for name, get in self.named}
        if self.kind == "tuple":
            return tuple([get(j) for get in getters])
        return getters[0](j)

    def check_open(self) -> list[Any]:
        """The column getters; ``ValueError`` once closed."""
        if self.getters is None:
            raise _closed()
        return self.getters

    def close(self) -> None:
        if self.map is None:
            return
        self.getters = None
        self.named = []  # (record() looks at getters first)
        self.arrays = []
        try:
            self.map.close()
        except BufferError:
            pass  # a column array is still alive: the mapping goes with it
        self.map = None
        if self._close_fd is not None:
            self._close_fd()


def _text_getter(mm: mmap.mmap, offset: Any, decode: bool) -> Any:
    if decode:
        return lambda j: mm[offset(j) : offset(j + 1)].decode("utf-8", "surrogatepass")
    return lambda j: mm[offset(j) : offset(j + 1)]


def _rebuild(where: tuple, token: str, span: tuple[int, int, int]) -> Records:
    """Unpickling: map the file the pickled Records names (its owner's descriptor, or a saved file)."""
    if where[0] == "path":
        fd = os.open(where[1], os.O_RDONLY)
    else:
        pid = where[1]
        try:
            fd = open_proc_address(where[1:])
        except OSError as exc:
            raise RuntimeError(
                f"procpipe.Records: the shared records of process {pid} are gone (that process exited or "
                "closed them); a Records can only be unpickled while the Records it was made from is open. "
                "To keep records across processes, use records.save(path) and Records.load(path)."
            ) from exc
    try:
        store = _Store(fd, where, populate=False, own_fd=False)
    finally:
        os.close(fd)
    if store.token != token:
        raise RuntimeError(f"procpipe.Records: the file at {where} is not the one that was pickled")
    return Records._view(store, range(*span))


# ---------------------------------------------------------------------- packing
def _pack(items: Iterable[Any]) -> tuple[bytes, list[tuple[int, Any]], int]:
    """Validate and pack records: (header bytes, [(file position, buffer)], file size)."""
    items = items if isinstance(items, (list, tuple)) else list(items)
    names: list[Any]  # a dict's keys, a tuple's positions, or [0]
    values: list[Sequence[Any]]  # one sequence per column
    if not items:
        raise ValueError("procpipe.Records needs at least one record")
    first = items[0]
    if isinstance(first, dict):
        kind, names = "dict", list(first)
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"record 0 has the key {name!r}: Records needs str keys")
        keys = first.keys()
        bad = next((i for i, r in enumerate(items) if not (isinstance(r, dict) and r.keys() == keys)), None)
        if bad is not None:
            r = items[bad]
            if not isinstance(r, dict):
                raise TypeError(
                    f"record {bad} is a {type(r).__name__}, but record 0 is a dict: "
                    "every record must be a dict with the same keys"
                )
            missing, extra = [k for k in names if k not in r], [k for k in r if k not in keys]
            raise ValueError(
                f"record {bad} does not have the keys of record 0 (missing {missing}, extra {extra}): "
                "every record needs the same keys; use a sentinel such as '' or -1 for a missing value"
            )
        values = [[r[name] for r in items] for name in names]
    elif isinstance(first, tuple):
        kind, width = "tuple", len(first)
        names = list(range(width))
        bad = next((i for i, r in enumerate(items) if not (isinstance(r, tuple) and len(r) == width)), None)
        if bad is not None:
            r = items[bad]
            what = f"a tuple of {len(r)}" if isinstance(r, tuple) else f"a {type(r).__name__}"
            raise ValueError(
                f"record {bad} is {what}, but record 0 is a tuple of {width}: "
                "every record must be a tuple of the same length"
            )
        values = [[r[k] for r in items] for k in names]
    else:
        kind, names, values = "scalar", [0], [items]
    if not names:
        raise ValueError(f"record 0 is an empty {type(first).__name__}: records need at least one field")

    columns: list[dict] = []
    chunks: list[tuple[int, Any]] = []  # (position after the header, buffer)
    text: list[tuple[np.ndarray, dict]] = []
    pos = 0
    for name, column in zip(names, values, strict=True):
        label = {"dict": f" field {name!r}", "tuple": f" item {name}", "scalar": ""}[kind]
        typ, array, data = _column(column, label)
        entry: dict[str, Any] = {"name": name, "type": typ}
        payload: np.ndarray | bytes = array
        if data is not None:  # text: the offsets, then the bytes
            entry["offsets"] = pos
            chunks.append((pos, array))
            text.append((array, entry))
            pos = aligned(pos + array.nbytes)
            payload = data
        entry["offset"] = pos
        chunks.append((pos, payload))
        pos = aligned(pos + (payload.nbytes if isinstance(payload, np.ndarray) else len(payload)))
        columns.append(entry)
    header = json.dumps(
        {"version": 1, "token": secrets.token_hex(8), "kind": kind, "length": len(items), "columns": columns}
    ).encode()
    base = aligned(16 + len(header))
    for offsets, entry in text:  # offsets into the text become absolute file positions
        np.add(offsets, base + entry["offset"], out=offsets)  # in place: the arrays in `chunks` are these
    return MAGIC + struct.pack("<Q", len(header)) + header, [(base + p, a) for p, a in chunks], base + pos


def _column(values: Sequence[Any], label: str) -> tuple[str, np.ndarray, bytes | None]:
    """One column: (type, array, None) for numbers and bools; (type, offsets, data) for text."""
    types = set(map(type, values))
    if all(issubclass(t, str) for t in types):
        joined = "".join(values)
        if joined.isascii():
            data, lengths = joined.encode("ascii"), map(len, values)
        else:
            encoded = [v.encode("utf-8", "surrogatepass") for v in values]
            data, lengths = b"".join(encoded), map(len, encoded)
        return "str", _offsets(lengths, len(values)), data
    if all(issubclass(t, bytes) for t in types):
        return "bytes", _offsets(map(len, values), len(values)), b"".join(values)
    if all(issubclass(t, _BOOLS) for t in types):
        return "bool", np.array(values, np.bool_), None
    if all(issubclass(t, _NUMBERS) and not issubclass(t, _BOOLS) for t in types):
        if all(issubclass(t, int) for t in types):  # Python ints: exact, or an error
            try:
                return "<i8", np.array(values, np.int64), None
            except OverflowError:
                if min(values) >= 0 and max(values) < 2**64:
                    return "<u8", np.array(values, np.uint64), None
        else:  # with a float, a float column; numpy scalars keep their dtype
            array = np.array(values)
            if array.dtype.kind in "iuf":
                return array.dtype.str, array, None
        i = next((i for i, v in enumerate(values) if isinstance(v, int) and not -(2**63) <= v < 2**63), 0)
        raise OverflowError(
            f"record {i}{label} is {values[i]!r:.60}: out of range of a 64-bit column "
            "(int64, or uint64 if no value is negative)"
        )
    seen: dict[str, int] = {}  # kind of value -> first record holding it
    for i, v in enumerate(values):
        if v is None:
            raise ValueError(
                f"record {i}{label} is None: Records cannot hold None; use a sentinel "
                "(such as '' or -1) or leave the field out of every record"
            )
        kind = (
            "str"
            if isinstance(v, str)
            else "bytes"
            if isinstance(v, bytes)
            else "bool"
            if isinstance(v, _BOOLS)
            else "a number"
            if isinstance(v, _NUMBERS)
            else None
        )
        if kind is None:
            raise TypeError(
                f"record {i}{label} is a {type(v).__name__} ({v!r:.60}): Records holds "
                "str, bytes, bool, int, float or numpy scalars"
            )
        seen.setdefault(kind, i)
        if len(seen) > 1:
            other, j = next(iter(seen.items()))
            raise TypeError(
                f"record {i}{label} is {kind} but record {j}{label} is {other}: "
                "each field must hold one kind of value in every record"
            )
    raise AssertionError("unreachable")  # pragma: no cover


def _offsets(lengths: Iterable[int], n: int) -> np.ndarray:
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.fromiter(lengths, np.int64, n), out=offsets[1:])
    return offsets


def _write(fd: int, header: bytes, parts: list[tuple[int, Any]]) -> None:
    _pwrite(fd, header, 0)
    for pos, buffer in parts:
        _pwrite(fd, buffer, pos)


def _pwrite(fd: int, buffer: Any, pos: int) -> None:
    with memoryview(buffer) as view, view.cast("B") as flat:
        done = 0
        while done < len(flat):
            done += os.pwrite(fd, flat[done:], pos + done)


def _closed() -> ValueError:
    return ValueError("this procpipe.Records is closed")
