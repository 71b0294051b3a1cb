"""The cache of a stream without record counts (``Shards`` without ``lengths``): a file that grows.

``cache=...`` with a ``procpipe.Shards`` whose ``lengths`` are known uses cache.py's file,
laid out for every record up front. Without them the number of records is unknown until
each shard has been read, so this cache grows as records arrive: one file, shared by the
loader and all its workers, made of

- a **shard table** (fixed, one 32-byte entry per shard): the offset of the shard's first
  *chunk*, and the shard's end (its record count, once a reader has reached it, with a
  CRC-32), so a block past a shard's last records can be served without opening the shard;
- **chunks** of ``chunk`` record slots of one shard, appended at the end of the file when a
  record of a shard needs one. A chunk starts with the offset of the shard's next chunk
  (a chain per shard); a slot is ``[filled byte][CRC-32][fields...]``, the fields laid out
  by cache_file.py's ``Layout`` of the first record (typed arrays and numbers, as in cache.py), which
  also matches each later record against it and builds a stored one back.

Concurrent writers: any worker may read any shard (a block can run twice: a restart after
a worker died, ``speculate``), so nothing relies on one writer per shard. Growing the file
(appending a chunk and linking it) happens under a POSIX record lock of the file's first
byte (``lockf``: the creator's ``flock``, the reaper's sign of life, is separate), and a link is
only ever set once; a record is written with ``pwrite`` (its fields and CRC, then its filled
byte), so a reader that sees the byte set sees the whole record. Two processes storing the
same record write the same bytes (``fn`` is deterministic). A worker that dies mid-write
leaves the byte clear: the record is computed again by whoever reads it next, exactly once
in the epoch's output either way (the cache only ever replaces ``fn``'s output by itself).

Integrity: every read checks the file's size is the table plus whole chunks, that a link
points at a chunk inside the file, the filled byte, and the CRC-32 of the record's key
``(shard, record)`` and stored bytes, so a changed, truncated or re-linked file raises
``CacheError`` naming the file, never silently wrong data. Where it lives, its lifetime and
naming are cache.py's (cache_file.py ``create_storage``): in the loader's shared memory (never shrinking:
sealed), or a file in the ``cache=`` directory, reached through one descriptor by every process.
It is made by ``StreamCache.create``, which cache.py's ``open_cache`` (the one opening) calls.
"""

from __future__ import annotations

import fcntl
import os
import threading
import weakref
import zlib
from typing import Any

import numpy as np

from .._core.rng import no_sample_rng
from .._core.shm import Segments, remove_file
from ..errors import CacheError, SharedMemoryError
from .cache_file import Layout, Storage, create_storage, directory_of, release_storage
from .worker_spec import WorkerSpec

ENTRY = 32  # bytes per shard in the table: [first chunk: u64][end + 1: u64][crc of end: u32][pad]
LINK = 64  # bytes before a chunk's slots: [next chunk: u64][pad]
SLOT_HEAD = 8  # [filled: u8][pad: 3][crc: u32]
CHUNK_BYTES = 1 << 20  # a chunk holds about this many bytes of records (at least one record)
MAX_CHUNK = 256  # and at most this many
_GROWING = threading.Lock()  # (a POSIX record lock excludes other processes only, not this one's threads)
NO_RNG = (
    "procpipe.sample_rng() was called while computing a cached record (cache=... is on): fn's output is "
    "stored once per record and reused in every epoch, so it must be deterministic. Move random "
    "augmentation into augment=..., which runs every epoch on the cached record and may use sample_rng()."
)


class StreamCache:
    """The growing cache file, opened in this process; pickled (for the workers) as its description."""

    def __init__(self, storage: Storage, shards: int, skeleton: list, fields: list, directory: str | None) -> None:
        self.storage = storage
        self.shards = shards
        self.skeleton = skeleton
        self.fields = fields
        self.directory = directory
        self.layout = Layout(skeleton, fields)
        self.sample_bytes = self.layout.sample_bytes
        self.slot = -(-(SLOT_HEAD + self.sample_bytes) // 8) * 8
        self.chunk = max(1, min(MAX_CHUNK, CHUNK_BYTES // self.slot))
        self.chunk_bytes = LINK + self.chunk * self.slot
        self.table_bytes = self.table_bytes_for(shards)
        offset = SLOT_HEAD
        for f in fields:  # each field's place in a slot
            f.offset = offset
            offset += f.itemsize
        # (what reading a leaf needs, worked out once: a record is read thousands of times per epoch)
        self._leaves = [(f.kind, f.dtype, int(np.prod(f.shape, dtype=np.int64)), f.offset, f.shape) for f in fields]
        self._pid = 0
        self._chains: dict[int, list[int]] = {}  # shard -> its chunks' offsets found so far (links never change)
        self._finalizer: weakref.finalize | None = None

    @staticmethod
    def table_bytes_for(shards: int) -> int:
        """The bytes of the shard table (the file's start) for ``shards`` shards."""
        return -(-shards * ENTRY // 4096) * 4096

    def __getstate__(self) -> dict:
        return {
            "storage": self.storage,
            "shards": self.shards,
            "skeleton": self.skeleton,
            "fields": self.fields,
            "directory": self.directory,
        }

    def __setstate__(self, state: dict) -> None:
        StreamCache.__init__(self, **state)

    # -------------------------------------------------------------- the file
    def _file(self) -> int:
        """The cache's descriptor (the chains found so far are this process's: a forked worker starts afresh)."""
        if self._pid != os.getpid():
            self._pid, self._chains = os.getpid(), {}
        return self.storage.fd.fd

    def _size(self) -> int:
        size = os.fstat(self._file()).st_size
        if size < self.table_bytes or (size - self.table_bytes) % self.chunk_bytes:
            raise CacheError(
                f"{self.storage.label} is {size} bytes, which is not this loader's layout (a {self.table_bytes}"
                f"-byte shard table and chunks of {self.chunk_bytes} bytes): something other than procpipe truncated "
                "or changed it. Close the loader and create a new one (the cache is rebuilt), and keep other "
                "programs away from that file."
            )
        return size

    def _corrupt(self, what: str) -> CacheError:
        return CacheError(
            f"{self.storage.label} is corrupt: {what}; something other than procpipe changed its bytes. "
            "Close the loader and create a new one (the cache is rebuilt), and keep other programs away from "
            "that file."
        )

    def _read_u64(self, offset: int) -> int:
        return int.from_bytes(os.pread(self._file(), 8, offset).ljust(8, b"\0"), "little")

    def _link(self, shard: int, at: int) -> int:
        """The chunk offset stored at ``at`` (0: none yet), checked to be a chunk of this file."""
        target = self._read_u64(at)
        if target and (
            target < self.table_bytes
            or (target - self.table_bytes) % self.chunk_bytes
            or target + self.chunk_bytes > self._size()
        ):
            raise self._corrupt(f"shard {shard}'s chain of chunks points at byte {target}, outside its chunks")
        return target

    def _chunk(self, shard: int, number: int, grow: bool) -> int:
        """The offset of chunk ``number`` of ``shard`` (appended if ``grow``); 0 if there is none."""
        chain = self._chains.setdefault(shard, [])
        while len(chain) <= number:
            at = shard * ENTRY if not chain else chain[-1]
            target = self._link(shard, at)
            if not target:
                if not grow:
                    return 0
                target = self._append(shard, at)
            chain.append(target)
        return chain[number]

    def _append(self, shard: int, at: int) -> int:
        """Append a chunk and link it at ``at``, under the file's lock."""
        fd = self._file()
        with _GROWING:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
            try:
                return self._append_locked(fd, shard, at)
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)

    def _append_locked(self, fd: int, shard: int, at: int) -> int:
        """Append a chunk and link it at ``at`` (the lock held), unless another process just did."""
        target = self._link(shard, at)
        if target:
            return target
        target = self._size()
        try:
            os.posix_fallocate(fd, target, self.chunk_bytes)
        except OSError as exc:
            raise SharedMemoryError(
                f"procpipe could not grow {self.storage.label} by {self.chunk_bytes} bytes: {exc}. Free "
                "some memory or space there, pass cache='/a/directory' on a larger filesystem, or cache=False."
            ) from exc
        os.pwrite(fd, target.to_bytes(8, "little"), at)
        return target

    def close(self) -> None:
        """In the process that created it: close its descriptor and remove its file. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()

    # -------------------------------------------------------------- shard ends
    def shard_end(self, shard: int) -> int | None:
        """The record count of ``shard``, once a reader has reached its end; None before."""
        raw = os.pread(self._file(), 12, shard * ENTRY + 8).ljust(12, b"\0")
        end = int.from_bytes(raw[:8], "little")
        if not end:
            return None
        if zlib.crc32(raw[:8], shard) != int.from_bytes(raw[8:], "little"):
            raise self._corrupt(f"the stored end of shard {shard} does not match its checksum")
        return end - 1

    def set_end(self, shard: int, records: int) -> None:
        """Store that ``shard`` has ``records`` records (a reader reached its end)."""
        raw = (records + 1).to_bytes(8, "little")
        os.pwrite(self._file(), raw + zlib.crc32(raw, shard).to_bytes(4, "little"), shard * ENTRY + 8)

    # -------------------------------------------------------------- records
    def _where(self, key: Any, grow: bool) -> int:
        shard, record = int(key[0]), int(key[1])
        chunk = self._chunk(shard, record // self.chunk, grow)
        return chunk and chunk + LINK + (record % self.chunk) * self.slot

    def get(self, key: Any) -> Any | None:
        """A private copy of ``fn``'s output for record ``key = (shard, record)``, or None if not stored."""
        at = self._where(key, False)
        if not at:
            return None
        raw = os.pread(self._file(), self.slot, at)
        if len(raw) != self.slot:
            self._size()  # (raises: the file was cut)
            raise self._corrupt(f"the slot of {key!r} is cut short")
        if raw[0] == 0:
            return None
        if raw[0] != 1:
            raise self._corrupt(f"the filled byte of {key!r} is {raw[0]}, not 0 or 1")
        if self._crc(key, raw) != int.from_bytes(raw[4:8], "little"):
            raise self._corrupt(f"the stored bytes of {key!r} do not match their checksum")
        values = []
        for kind, dtype, count, offset, shape in self._leaves:
            value = np.frombuffer(raw, dtype, count, offset)
            values.append(
                value.reshape(shape).copy() if kind == "array" else value[0] if kind == "scalar" else value[0].item()
            )
        return self.layout.build(values)

    def _crc(self, key: Any, raw: bytes) -> int:
        head = int(key[0]).to_bytes(8, "little") + int(key[1]).to_bytes(8, "little")
        return zlib.crc32(memoryview(raw)[SLOT_HEAD:], zlib.crc32(head))

    def put(self, key: Any, sample: Any) -> None:
        """Store ``sample`` as record ``key``; ``CacheError`` if it does not match the first record's layout."""
        leaves = self.layout.leaves(sample, f"record {key!r}", "record", "Every record's fn output")
        slot = bytearray(self.slot)
        for f, value in zip(self.fields, leaves, strict=True):
            slot[f.offset : f.offset + f.itemsize] = np.ascontiguousarray(value, f.dtype).tobytes()
        slot[4:8] = self._crc(key, bytes(slot)).to_bytes(4, "little")
        at = self._where(key, True)
        fd = self._file()
        os.pwrite(fd, memoryview(slot)[1:], at + 1)  # the record and its CRC first,
        os.pwrite(fd, b"\1", at)  # then its filled byte (a reader checks it first)

    def compute(self, key: Any, source: Any, fn: Any) -> Any:
        """Run ``fn`` on ``source[key]`` (the record just read), store it, and return the stored copy."""
        with no_sample_rng(NO_RNG):
            sample = source[key]
            if fn is not None:
                sample = fn(sample)
        self.put(key, sample)
        return self.get(key)

    # -------------------------------------------------------------- status
    def filled(self) -> tuple[int, int | None]:
        """``(records stored, records of all shards or None while a shard's end is unknown)``: the
        filled bytes only, read through a map of the file (a status query reads no record)."""
        import mmap

        stored = 0
        known: int | None = 0
        view = mmap.mmap(self._file(), self._size(), prot=mmap.PROT_READ)
        try:
            for shard in range(self.shards):
                number = 0
                while at := self._chunk(shard, number, False):
                    if at + self.chunk_bytes > len(view):  # (grown by a worker since it was mapped)
                        view.close()
                        view = mmap.mmap(self._file(), self._size(), prot=mmap.PROT_READ)
                    flags = np.frombuffer(view, np.uint8, self.chunk_bytes, at)[LINK :: self.slot]
                    bad = bool(np.any(flags > 1))
                    stored += int(np.count_nonzero(flags))
                    del flags  # (no view of the map may outlive it)
                    if bad:
                        raise self._corrupt(f"a filled byte of shard {shard} is neither 0 nor 1")
                    number += 1
                end = self.shard_end(shard)
                known = None if end is None or known is None else known + end
        finally:
            view.close()
        return stored, known

    def info(self) -> dict[str, Any]:
        """``Loader.cache_info()``: ``samples`` is None until every shard's end was reached; a damaged
        file is reported (``error``; ``filled`` None), never raised."""
        try:
            (filled, samples), size, error = self.filled(), self._size(), None
        except CacheError as exc:
            filled, samples, size, error = None, None, None, str(exc)
        return {
            "directory": self.directory,
            "samples": samples,
            "filled": filled,
            "sample_bytes": self.sample_bytes,
            "bytes": size,
            "error": error,
        }

    @classmethod
    def create(cls, spec: WorkerSpec, cache: Any, segments: Segments, workers: bool) -> StreamCache | None:
        """Create the growing cache of a stream: its first record is read and run through ``fn``
        here, to lay the slots out (as cache.py's ``Cache.create`` does); None if every shard is
        empty. The arguments: as cache.py ``open_cache``'s, which calls this."""
        source = spec.source
        found = spec.producer.first_keyed(spec)  # (the same first record an indexed cache lays out by)
        if found is None:
            return None
        key, first = found
        layout = Layout.of(first)
        table_bytes = cls.table_bytes_for(len(source))
        what = "the stream cache (growing as records arrive)"
        fixes = "pass cache='/a/directory/on/disk', or cache=False"
        storage = create_storage(cache, segments, table_bytes, what, fixes, growing=True)
        result = cls(storage, len(source), layout.skeleton, layout.fields, directory_of(cache))
        result._finalizer = weakref.finalize(result, release_storage, storage, os.getpid())
        try:
            if not workers and storage.path is not None:
                remove_file(storage.path)  # workers=0: only this process uses it, through its descriptor
            result.put(key, first)
        except BaseException:
            result.close()
            raise
        return result
