"""The sample cache (``Loader(cache=...)``): ``fn``'s output per index, computed once.

``fn`` (with the source's ``__getitem__``) is the deterministic first stage; its output
for index ``i`` is stored the first time any process computes it, and every later epoch
reads it back instead of running ``fn`` again (``augment``, the random stage, still runs
every epoch, on a copy).

Storage is one file of typed arrays, not pickles: its structure comes from the first
sample (computed in the calling process when the loader is created): every leaf of the
sample tree (an array, or a number) is one *field*, stored as an array of shape
``(N,) + leaf_shape`` with the leaf's dtype, each field 64-byte aligned, after one
"filled" byte per index and, for a cache in a directory (a file on disk), one CRC-32
per index over the sample's stored bytes::

    [filled: N bytes][crc: N x uint32, directory caches][field 0: N x leaf0][field 1: N x leaf1]...

Every process of the loader reaches the cache through one descriptor (``Storage``: inherited,
or shipped with the spec, shm.py), never by a name. Its size is checked on every read: a
truncated file, a filled byte that is neither 0 nor 1, or a sample whose bytes no longer match
their CRC raises ``CacheError`` naming the file, instead of SIGBUS or silently wrong data (a
cache in memory is sealed against truncation: shm.py).

A process writes a sample's fields (and CRC), then sets its filled byte; a reader copies a sample
only once its byte is set. A worker that dies mid-write leaves the byte clear (the index
is computed again); two processes filling the same index write the same bytes (``fn`` is
deterministic), so concurrent fills are harmless. The tree's skeleton (dict keys,
container types) and the field list travel in the ``WorkerSpec``, shipped once.

Where it lives (``create_storage``): ``cache=True``/``"memory"``: in the loader's shared memory
(anonymous, or a file in ``shm_dir`` when one is given), gone with the loader like the ring.
``cache="/a/dir"``: a memory-mapped file in that directory (for caches larger than memory),
named like the loader's files; it is temporary too: removed by ``close()``, garbage collection,
interpreter exit, the reaper if the loader is killed, and by workers whose parent was killed
(its prefix is among their ``leftovers``). With ``workers=0`` the file is unlinked as soon as it
is made, so nothing can be left behind.
"""

from __future__ import annotations

import operator
import os
import weakref
import zlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from .._core.rng import no_sample_rng
from .._core.shm import Segments, SharedFd, check_capacity, close_fd, map_fd, open_new_file, remove_file
from ..config import CACHE_IN_MEMORY
from ..errors import CacheError

if TYPE_CHECKING:
    from .worker_spec import WorkerSpec

MEMORY = CACHE_IN_MEMORY  # cache="memory" (checked with the other arguments: config.py)
ALIGN = 64
# The skeleton of a ``Layout``: [DICT, keys, children] a mapping, [SEQ, type, children] a sequence,
# [LEAF, field] a leaf.
DICT, SEQ, LEAF = 0, 1, 2
# Python number types and the dtype they are stored as (restored as the Python type).
_PY_NUMBERS = {
    bool: np.dtype(np.bool_),
    int: np.dtype(np.int64),
    float: np.dtype(np.float64),
    complex: np.dtype(np.complex128),
}
NO_RNG = (
    "procpipe.sample_rng() was called while computing a cached sample (cache=... is on): the cached "
    "stage (the source's __getitem__ and fn) runs once per index and its output is reused in every "
    "epoch, so it must be deterministic. Move random augmentation into augment=..., which runs every "
    "epoch on top of the cached sample and may use sample_rng()."
)


def _path_str(path: tuple) -> str:
    return "sample" + "".join(f"[{p!r}]" for p in path)


def _seq_type(value: Any) -> type:
    return type(value) if type(value) in (tuple, list) or hasattr(value, "_fields") else list


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Field:
    """One leaf of the sample tree: ``kind`` is ``"array"``, ``"scalar"`` (a numpy scalar) or a
    Python number type's name (``"int"``...), restored as that type."""

    __slots__ = ("dtype", "itemsize", "kind", "offset", "path", "shape")

    def __init__(self, kind: str, dtype: np.dtype, shape: tuple, path: tuple) -> None:
        self.kind, self.dtype, self.shape, self.path = kind, dtype, shape, path
        self.itemsize = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.offset = 0

    def __getstate__(self) -> tuple:  # (the dtype itself: its .str would lose a structured dtype's fields)
        return (self.kind, self.dtype, self.shape, self.path, self.offset, self.itemsize)

    def __setstate__(self, state: tuple) -> None:
        self.kind, self.dtype, self.shape, self.path, self.offset, self.itemsize = state

    def describe(self) -> str:
        if self.kind == "array":
            return f"an array of shape {self.shape} and dtype {self.dtype}"
        if self.kind == "scalar":
            return f"a numpy {self.dtype} scalar"
        return f"a Python {self.kind}"


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    if isinstance(value, np.generic):
        return f"a numpy {value.dtype} scalar"
    return f"a {type(value).__name__}"


class Layout:
    """How a cached sample is laid out: the skeleton of its tree (``[DICT, keys, children]``,
    ``[SEQ, type, children]``, ``[LEAF, field]``) and its fields (one per leaf: an array or a
    number), taken from the first sample (``Layout.of``). Both caches store samples by it: this
    module's ``Cache`` (a field per array, a row per index) and a growing stream's
    ``stream_cache.StreamCache`` (a slot of bytes per record). ``leaves`` matches a later sample
    against it (the values to store, field by field, or a ``CacheError`` naming what differs);
    ``build`` makes a sample again from its stored leaves."""

    __slots__ = ("_build", "fields", "skeleton")

    def __init__(self, skeleton: list, fields: list[Field]) -> None:
        self.skeleton = skeleton
        self.fields = fields
        self._build: Callable[[list[Any]], Any] | None = None

    @classmethod
    def of(cls, sample: Any) -> Layout:
        """The layout of ``sample``; ``CacheError`` for a leaf that is neither an array nor a number."""
        fields: list[Field] = []

        def walk(value: Any, path: tuple) -> list:
            if isinstance(value, Mapping):
                keys = tuple(value.keys())
                return [DICT, keys, [walk(value[k], path + (k,)) for k in keys]]
            if isinstance(value, (tuple, list)):
                return [SEQ, _seq_type(value), [walk(v, path + (j,)) for j, v in enumerate(value)]]
            if isinstance(value, np.ndarray) and not value.dtype.hasobject:
                fields.append(Field("array", value.dtype, value.shape, path))
            elif type(value) in _PY_NUMBERS:
                if type(value) is int and not -(2**63) <= value < 2**63:
                    raise CacheError(f"cache=... cannot store {_path_str(path)} = {value}: it does not fit in int64")
                fields.append(Field(type(value).__name__, _PY_NUMBERS[type(value)], (), path))
            elif isinstance(value, (np.number, np.bool_)):
                fields.append(Field("scalar", value.dtype, (), path))
            else:
                raise CacheError(
                    f"cache=... stores arrays and numbers only, but {_path_str(path)} is {_describe(value)}. "
                    "Return only numpy arrays, numbers and dicts/tuples/lists of them from the cached stage (fn), "
                    "e.g. encode labels as ints; add str/bytes/object fields in augment=... (uncached), or pass "
                    "cache=False."
                )
            return [LEAF, len(fields) - 1]

        return cls(walk(sample, ()), fields)

    @property
    def sample_bytes(self) -> int:
        """The bytes of one sample's fields."""
        return sum(f.itemsize for f in self.fields)

    def leaves(self, sample: Any, item: str, unit: str, rule: str) -> list[Any]:
        """The leaves of ``sample`` in field order, each checked against its field; else a
        ``CacheError`` naming the leaf: ``item`` names the sample (``"index 10"``), ``unit`` the
        kind of the first one the layout came from (``"sample"``), ``rule`` whose structure must
        match (``"Every sample of a cached fn"``)."""
        leaves: list[Any] = [None] * len(self.fields)

        def mismatch(path: tuple, expected: str, got: str) -> CacheError:
            return CacheError(
                f"cache=...: {_path_str(path)} of {item} is {got}, but the cache was laid out from the first "
                f"{unit}, where it is {expected}. {rule} must have the same structure, dtypes and shapes: make "
                "fn return fixed-shape arrays (resize, crop or pad in fn), or pass cache=False."
            )

        def match(node: list, value: Any, path: tuple) -> None:
            kind = node[0]
            if kind == DICT:
                if not isinstance(value, Mapping) or set(value.keys()) != set(node[1]):
                    raise mismatch(
                        path,
                        f"a mapping with keys {sorted(map(str, node[1]))}",
                        f"a mapping with keys {sorted(map(str, value.keys()))}"
                        if isinstance(value, Mapping)
                        else _describe(value),
                    )
                for key, child in zip(node[1], node[2], strict=True):
                    match(child, value[key], path + (key,))
                return
            if kind == SEQ:
                length = len(node[2])
                if not isinstance(value, (tuple, list)) or len(value) != length:
                    raise mismatch(
                        path,
                        f"a {node[1].__name__} of length {length}",
                        f"a {type(value).__name__} of length {len(value)}"
                        if isinstance(value, (tuple, list))
                        else _describe(value),
                    )
                for j, child in enumerate(node[2]):
                    match(child, value[j], path + (j,))
                return
            field = self.fields[node[1]]
            if field.kind == "array":
                ok = isinstance(value, np.ndarray) and value.shape == field.shape and value.dtype == field.dtype
            else:
                ok = isinstance(value, (bool, int, float, complex, np.number, np.bool_)) and np.can_cast(
                    np.asarray(value).dtype, field.dtype, "safe"
                )
            if not ok:
                raise mismatch(path, field.describe(), _describe(value))
            leaves[node[1]] = value

        match(self.skeleton, sample, ())
        return leaves

    def build(self, values: list[Any]) -> Any:
        """The sample made again from its stored leaves, ``values[n]`` being field ``n``'s (restored).
        (The skeleton is compiled into nested constructors once: a sample is built per read.)"""
        if self._build is None:
            self._build = _builder(self.skeleton)
        return self._build(values)


def _builder(node: list) -> Callable[[list[Any]], Any]:
    """A function making the tree of ``node`` (a ``Layout`` skeleton) from the list of its leaves."""
    kind = node[0]
    if kind == LEAF:
        return operator.itemgetter(node[1])
    parts = [_builder(child) for child in node[2]]
    if kind == DICT:
        keys = node[1]
        return lambda values: dict(zip(keys, [part(values) for part in parts], strict=True))
    seq_type = node[1]
    if seq_type is list:
        return lambda values: [part(values) for part in parts]
    if seq_type is tuple:
        return lambda values: tuple([part(values) for part in parts])
    return lambda values: seq_type(*[part(values) for part in parts])  # namedtuple


class Storage(NamedTuple):
    """Where a cache's bytes are: ``fd``, the descriptor every process of the loader maps; ``path``,
    its file's name (None: anonymous memory); ``label``, how a message names it."""

    fd: SharedFd
    path: str | None
    label: str


class Cache:
    """The cache file, mapped in this process; pickled (for the workers) as its description only."""

    def __init__(
        self,
        storage: Storage,
        length: int,
        skeleton: list,
        fields: list[Field],
        nbytes: int,
        directory: str | None,
        crc_offset: int | None = None,
    ) -> None:
        self.storage = storage
        self.length = length
        self.skeleton = skeleton
        self.fields = fields
        self.nbytes = nbytes
        self.directory = directory
        self.crc_offset = crc_offset  # where the per-sample CRC-32s are (None: not checksummed)
        self.layout = Layout(skeleton, fields)
        self._kinds = [f.kind for f in fields]
        self.sample_bytes = self.layout.sample_bytes
        self._map: Any = None
        self._flags: np.ndarray | None = None
        self._crcs: np.ndarray | None = None
        self._bytes: np.ndarray | None = None
        self._arrays: list[np.ndarray] = []
        self._finalizer: weakref.finalize | None = None

    # -------------------------------------------------------------- pickling (to workers)
    def __getstate__(self) -> dict:
        return {
            "storage": self.storage,
            "length": self.length,
            "skeleton": self.skeleton,
            "fields": self.fields,
            "nbytes": self.nbytes,
            "directory": self.directory,
            "crc_offset": self.crc_offset,
        }

    def __setstate__(self, state: dict) -> None:
        type(self).__init__(self, **state)

    # -------------------------------------------------------------- mapping
    def _attach(self) -> np.ndarray:
        """Map the cache, without populating it (a directory cache may be larger than memory); its ``_flags``.

        Only at its full size: a truncated file would kill the process with SIGBUS at the first
        read past its end. Every later read checks the size again (``_check``).
        """
        fd = self.storage.fd.fd
        try:
            self._check(os.fstat(fd).st_size)
            self._map = map_fd(fd, self.nbytes, populate=False)
        except OSError as exc:
            raise CacheError(f"cannot map {self.storage.label}: {exc}") from exc
        self._flags = flags = np.ndarray((self.length,), np.uint8, buffer=self._map, offset=0)
        if self.crc_offset is not None:
            self._crcs = np.ndarray((self.length,), np.uint32, buffer=self._map, offset=self.crc_offset)
            self._bytes = np.ndarray((self.nbytes,), np.uint8, buffer=self._map)
        self._arrays = [
            np.ndarray((self.length,) + f.shape, f.dtype, buffer=self._map, offset=f.offset) for f in self.fields
        ]
        return flags

    def _check(self, size: int | None = None) -> None:
        """``CacheError`` naming the file unless it still has its full size (``size``; by default
        the mapped file's, one fstat of the map's own descriptor)."""
        if size is None:
            size = self._map.size()
        if size != self.nbytes:
            raise CacheError(
                f"{self.storage.label} is {size} bytes, but this loader laid it out as {self.nbytes} bytes: "
                "something other than procpipe truncated or changed it. Close the loader and create a new one "
                "(the cache is rebuilt), and keep other programs away from that file."
            )

    def _corrupt(self, index: int, what: str) -> CacheError:
        return CacheError(
            f"{self.storage.label} is corrupt: {what} of index {index}; something other than procpipe "
            "changed its bytes. Close the loader and create a new one (the cache is rebuilt), and keep other "
            "programs away from that file."
        )

    def _crc(self, index: int) -> int:
        """CRC-32 of the stored bytes of sample ``index`` (every field's row, in field order)."""
        crc, raw = 0, cast(Any, self._bytes)  # (an ndarray: a buffer, which numpy's stubs say from Python 3.12)
        for f in self.fields:
            start = f.offset + index * f.itemsize
            crc = zlib.crc32(raw[start : start + f.itemsize], crc)
        return crc

    def close(self) -> None:
        """Unmap (here) and, in the process that created it, remove the file. Idempotent."""
        self._flags, self._crcs, self._bytes, self._arrays = None, None, None, []
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive somewhere; unmapped when it dies
                pass
            self._map = None
        if self._finalizer is not None:
            self._finalizer()

    # -------------------------------------------------------------- samples
    def get(self, index: int) -> Any | None:
        """A private copy of the cached sample ``index``, or None if it was never filled."""
        if (flags := self._flags) is None:
            flags = self._attach()
        self._check()
        flag = flags[index]
        if not flag:
            return None
        if flag != 1:
            raise self._corrupt(index, f"the filled byte is {flag}, not 0 or 1")
        if self._crcs is not None and self._crc(index) != self._crcs[index]:
            raise self._corrupt(index, "the stored bytes do not match their checksum")
        # (a copy of an array: augment may change it in place; a Python number as fn returned it)
        return self.layout.build(
            [
                np.array(array[index]) if kind == "array" else array[index] if kind == "scalar" else array[index].item()
                for array, kind in zip(self._arrays, self._kinds, strict=True)
            ]
        )

    def put(self, index: int, sample: Any) -> None:
        """Store ``sample`` as index ``index``; ``CacheError`` if it does not match the first sample."""
        if (flags := self._flags) is None:
            flags = self._attach()
        leaves = self.layout.leaves(sample, f"index {index}", "sample", "Every sample of a cached fn")
        self._check()
        for array, value in zip(self._arrays, leaves, strict=False):
            array[index] = value
        if self._crcs is not None:
            self._crcs[index] = self._crc(index)
        # The data is written before the flag; a reader checks the flag first. (Stores are not reordered
        # on x86; elsewhere, the interpreter does far more than a barrier's worth of work between the two.)
        flags[index] = 1

    def filled(self) -> int:
        """How many indices are in the cache."""
        if (flags := self._flags) is None:
            flags = self._attach()
        self._check()
        return int(np.count_nonzero(flags))

    def compute(self, index: int, source: Any, fn: Any) -> Any:
        """Run the cached stage for ``index``, store it, and return the stored copy."""
        with no_sample_rng(NO_RNG):
            sample = source[index]
            if fn is not None:
                sample = fn(sample)
        self.put(index, sample)
        return self.get(index)

    def shard_end(self, shard: int) -> int | None:
        """None: this cache is laid out for every record up front (a stream's ``lengths``), it stores no shard end."""
        return None

    def set_end(self, shard: int, records: int) -> None:
        """Nothing to store: the shards' ends are known (``lengths``); only a growing cache keeps them."""

    def info(self) -> dict[str, Any]:
        """``Loader.cache_info()``: a damaged file is reported (``error``; ``filled`` None), never raised."""
        try:
            filled, error = self.filled(), None
        except CacheError as exc:
            filled, error = None, str(exc)
        return {
            "directory": self.directory,
            "samples": self.length,
            "filled": filled,
            "sample_bytes": self.sample_bytes,
            "bytes": self.nbytes,
            "error": error,
        }


# ------------------------------------------------------------------ creation and cleanup
def wanted(cache: Any) -> bool:
    """Whether a ``cache=`` argument asks for a cache."""
    return cache is not None and cache is not False


def directory_of(cache: Any) -> str | None:
    """The directory a ``cache=`` argument keeps the cache in; None: the loader's shared memory."""
    if cache is True or cache == MEMORY:
        return None
    return os.fspath(cache)


def prefix_of(cache: Any, segments: Segments) -> str | None:
    """The prefix of the files a loader's cache makes outside its shared memory (a directory
    cache's), for workers to remove if the loader is killed; None: none."""
    directory = directory_of(cache) if wanted(cache) else None
    return None if directory is None else os.path.join(os.path.abspath(directory), segments.token)


def create_storage(cache: Any, segments: Segments, nbytes: int, what: str, fixes: str, growing: bool) -> Storage:
    """A new cache's ``Storage`` of ``nbytes`` (reserved): in the loader's shared memory
    (``segments``: anonymous, or a file in ``shm_dir``), or a file in the ``cache=`` directory;
    ``growing``: it may grow (a stream's cache), else its size is fixed."""
    directory = directory_of(cache)
    if directory is None:
        fd = segments.new("cache", nbytes, what, fixes, growing=growing)
        path = segments.path("cache") if segments.named else None
    else:
        check_capacity(directory, nbytes, what, fixes)
        path = os.path.join(os.path.abspath(directory), segments.token) + "cache"
        fd = open_new_file(path, nbytes, what)
    return Storage(SharedFd(fd), path, f"the cache file {path}" if path else "the cache in shared memory")


def release_storage(storage: Storage, pid: int) -> None:
    """A cache is done with, in the process ``pid`` that created it (a cache's finalizer): its
    descriptor is closed and its file, if any, removed (never from a forked worker that inherited it)."""
    if os.getpid() == pid:
        close_fd(storage.fd.fd)
        if storage.path is not None:
            remove_file(storage.path)  # (and the reaper forgets it)


def open_cache(spec: WorkerSpec, cache: Any, segments: Segments, workers: bool) -> Cache | None:
    """Create the cache of a loader: run the cached stage once here, to lay the file out.

    ``segments``: the loader's shared memory; ``workers``: whether worker processes will use it
    (``workers=0``: a file is unlinked at once, only this process needs it). Returns None when
    there is no cache (or no sample at all).
    """
    if not wanted(cache):
        return None
    reader = spec.producer  # the source kind's: an index per sample, or per (shard, record) of a stream
    length = reader.cache_length()
    if length == 0:
        return None
    index, first = reader.first_cached(spec)
    layout = Layout.of(first)
    fields = layout.fields
    offset = _align(length)  # the filled bytes
    crc_offset = None
    in_memory = directory_of(cache) is None
    if not in_memory:  # a file on disk: per-sample checksums catch changed bytes
        crc_offset, offset = offset, offset + _align(4 * length)
    for field in fields:
        field.offset = offset
        offset += _align(length * field.itemsize)
    nbytes = max(offset, 1)
    what = f"the sample cache ({length} samples x {layout.sample_bytes} bytes)"
    fixes = (
        "pass cache='/a/directory/on/disk' to keep the cache in a memory-mapped file there (for data larger "
        "than memory)"
        if in_memory
        else "pass a directory on a larger filesystem"
    ) + "; make the cached stage's output smaller (e.g. uint8 instead of float32, smaller images); or pass cache=False"
    storage = create_storage(cache, segments, nbytes, what, fixes, growing=False)
    directory = directory_of(cache) or segments.directory
    result = Cache(storage, length, layout.skeleton, fields, nbytes, directory, crc_offset)
    result._finalizer = weakref.finalize(result, release_storage, storage, os.getpid())
    try:
        if not workers and storage.path is not None:
            remove_file(storage.path)  # workers=0: only this process uses it, through its descriptor
        result._attach()
        result.put(index, first)
    except BaseException:
        result.close()
        raise
    return result
