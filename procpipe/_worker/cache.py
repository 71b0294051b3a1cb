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

Where it lives (cache_file.py ``create_storage``): ``cache=True``/``"memory"``: in the loader's shared memory
(anonymous, or a file in ``shm_dir`` when one is given), gone with the loader like the ring.
``cache="/a/dir"``: a memory-mapped file in that directory (for caches larger than memory),
named like the loader's files; it is temporary too: removed by ``close()``, garbage collection,
interpreter exit, the reaper if the loader is killed, and by workers whose parent was killed
(its prefix is among their ``leftovers``). With ``workers=0`` the file is unlinked as soon as it
is made, so nothing can be left behind.

``open_cache`` is the one place a loader's cache is opened (``assemble``, and a Ray agent on its
node): this module's ``Cache``, or the growing cache of a stream without ``lengths``
(stream_cache.py ``StreamCache``), as the source kind's producer asks (``cache_kind``). The
sample layout both store by (``Layout``) and their storage are cache_file.py's.
"""

from __future__ import annotations

import os
import weakref
import zlib
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .._core.rng import no_sample_rng
from .._core.shm import Segments, aligned, map_fd, remove_file
from ..errors import CacheError
from .cache_file import NO_RNG, Field, Layout, Storage, create_storage, directory_of, release_storage, wanted
from .stream_cache import StreamCache
from .worker_spec import GROWING

if TYPE_CHECKING:
    from .worker_spec import SampleCache, WorkerSpec


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

    @classmethod
    def create(cls, spec: WorkerSpec, cache: Any, segments: Segments, workers: bool) -> Cache | None:
        """Create the cache of a loader laid out for every index (or record: a stream with ``lengths``):
        run the cached stage once here, to lay the file out (``open_cache`` for the arguments).
        Returns None when there is no sample at all.
        """
        reader = spec.producer  # the source kind's: an index per sample, or per (shard, record) of a stream
        length = reader.cache_length()
        if length == 0:
            return None
        index, first = reader.first_cached(spec)
        layout = Layout.of(first)
        fields = layout.fields
        offset = aligned(length)  # the filled bytes
        crc_offset = None
        in_memory = directory_of(cache) is None
        if not in_memory:  # a file on disk: per-sample checksums catch changed bytes
            crc_offset, offset = offset, offset + aligned(4 * length)
        for field in fields:
            field.offset = offset
            offset += aligned(length * field.itemsize)
        nbytes = max(offset, 1)
        what = f"the sample cache ({length} samples x {layout.sample_bytes} bytes)"
        fixes = (
            (
                "pass cache='/a/directory/on/disk' to keep the cache in a memory-mapped file there (for data larger "
                "than memory)"
                if in_memory
                else "pass a directory on a larger filesystem"
            )
            + "; make the cached stage's output smaller (e.g. uint8 instead of float32, smaller images); "
            "or pass cache=False"
        )
        storage = create_storage(cache, segments, nbytes, what, fixes, growing=False)
        directory = directory_of(cache) or segments.directory
        result = cls(storage, length, layout.skeleton, fields, nbytes, directory, crc_offset)
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


def open_cache(spec: WorkerSpec, cache: Any, segments: Segments, workers: bool) -> SampleCache | None:
    """The cache of a loader (the one place one is opened), or None without one (or without a sample).

    ``cache``: the ``cache=`` argument; ``segments``: the loader's shared memory; ``workers``: whether
    worker processes will use it (``workers=0``: a file is unlinked at once, only this process needs
    it). The source kind's producer says which (``cache_kind``): the growing cache of a stream without
    ``lengths`` (stream_cache.py ``StreamCache``), else this module's ``Cache``, laid out up front.
    The first sample is computed here, to lay the file out.
    """
    if not wanted(cache):
        return None
    if spec.producer.cache_kind == GROWING:
        return StreamCache.create(spec, cache, segments, workers)
    return Cache.create(spec, cache, segments, workers)
