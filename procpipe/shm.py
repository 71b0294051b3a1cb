"""Shared memory: the ring of reusable batch slots, and the files behind it.

Every file a loader creates is named ``procpipe-<pid>-<token>-<what>`` in one directory
(``/dev/shm`` by default), so the whole set can be removed by prefix: by ``close()``, by
garbage collection of the loader, or by a worker that notices its parent was killed.

A slot is handed to the consumer as a *lease*: a small per-batch object that exports the
slot's bytes. Every array of the batch is a view whose ``.base`` is that object, so the
slot goes back to the free list exactly when the last array of the batch dies (a
``weakref.finalize`` on the lease), never earlier.
"""
from __future__ import annotations

import ctypes
import glob
import mmap
import os
import secrets
import weakref
from collections import deque
from collections.abc import Callable

import psutil

from .errors import SharedMemoryError

PAGE = mmap.PAGESIZE


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class SharedFiles:
    """Names and removes the files of one loader in its shared-memory directory."""

    def __init__(self, directory: str, prefix: str | None = None) -> None:
        """A new, unique set of names in ``directory``; or, given ``prefix``, an existing set
        (a worker removing the files of a loader that was killed)."""
        self.directory = directory
        self.prefix = prefix or os.path.join(directory, f"procpipe-{os.getpid()}-{secrets.token_hex(4)}-")

    @classmethod
    def from_prefix(cls, prefix: str) -> SharedFiles:
        return cls(os.path.dirname(prefix), prefix)

    def path(self, what: str) -> str:
        return self.prefix + what

    def remove_all(self) -> None:
        for path in glob.glob(glob.escape(self.prefix) + "*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def check_capacity(directory: str, needed: int, what: str) -> None:
    """Fail early, with the fix, if ``directory`` cannot hold ``needed`` more bytes."""
    free = psutil.disk_usage(directory).free
    if needed > free:
        raise SharedMemoryError(
            f"procpipe needs {_mib(needed)} in {directory} for {what}, but only {_mib(free)} is free. "
            "Fixes: lower prefetch, workers or batch_size (the ring holds prefetch + 2*workers + 1 batches, or prefetch + 4*workers + 1 for batches up to 1 MiB); "
            "in Docker, start the container with a larger --shm-size (e.g. --shm-size=2g); "
            "or pass shm_dir='/path/on/a/larger/filesystem'."
        )


LARGE_RESERVATION_BYTES = 1 << 30  # a ring this large is mentioned when it is made


def is_large_reservation(needed: int, free: int) -> bool:
    """Whether reserving ``needed`` bytes where ``free`` are free deserves a word to the user:
    more than ``LARGE_RESERVATION_BYTES``, or more than a quarter of what is free."""
    return needed > LARGE_RESERVATION_BYTES or needed > free // 4


def warn_large_ring(directory: str, slots: int, slot_bytes: int) -> None:
    """Say (once per ring) that the ring reserves a lot of ``directory``, and how to lower it."""
    needed, free = slots * slot_bytes, psutil.disk_usage(directory).free
    if is_large_reservation(needed, free):
        import warnings

        warnings.warn(
            f"procpipe: the ring reserves {_mib(needed)} of {directory} ({_mib(free)} free): {slots} slots "
            f"of {_mib(slot_bytes)}, the size of the first batch, one for each batch that may be ready or in "
            "flight at once (prefetch + 2*workers + 1, or prefetch + 4*workers + 1 for batches up to 1 MiB). "
            "To lower it: a smaller prefetch, fewer workers, or a smaller batch_size.",
            stacklevel=2,
        )


def create_file(path: str, size: int, what: str) -> None:
    """Create ``path`` with ``size`` bytes reserved now, so a full tmpfs fails here, not with SIGBUS later."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.unlink(path)
            raise SharedMemoryError(
                f"procpipe could not reserve {_mib(size)} in {os.path.dirname(path)} for {what}: {exc}. "
                "Free some space there, start Docker with a larger --shm-size, or pass shm_dir=... "
                "on a filesystem with room."
            ) from exc
    finally:
        os.close(fd)


def map_file(path: str) -> mmap.mmap:
    """Map a whole shared file read-write, pages populated up front."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)


def round_slot_bytes(nbytes: int) -> int:
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


class Ring:
    """A fixed number of equal slots in one shared file, and the consumer-side free list."""

    def __init__(self, files: SharedFiles, ring_id: int, slots: int, slot_bytes: int) -> None:
        self.ring_id = ring_id
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.path = files.path(f"ring{ring_id}")
        what = f"{slots} ring slots of {_mib(slot_bytes)}"
        check_capacity(files.directory, slots * slot_bytes, what)
        warn_large_ring(files.directory, slots, slot_bytes)
        create_file(self.path, slots * slot_bytes, what)
        self._map = map_file(self.path)
        self.free: deque[int] = deque(range(slots))
        # One exporter type per ring: its length is the slot size.
        self._lease_type = type("SlotLease", (ctypes.Array,), {"_type_": ctypes.c_char, "_length_": slot_bytes})

    def close(self) -> None:
        """Unmap the ring now (and close its file descriptor) unless a batch still uses it;
        then it is unmapped when the last such batch dies."""
        try:
            self._map.close()
        except BufferError:
            pass

    def lease(self, slot: int, on_release: Callable[[int], None]) -> ctypes.Array:
        """A per-batch object exporting slot ``slot``; ``on_release(slot)`` runs when it dies."""
        lease = self._lease_type.from_buffer(self._map, slot * self.slot_bytes)
        weakref.finalize(lease, on_release, slot)
        return lease


class WorkerRings:
    """A worker's view of the rings: maps each ring file the first time a task names it."""

    def __init__(self, files_prefix: str) -> None:
        self._prefix = files_prefix
        self._maps: dict[int, mmap.mmap] = {}

    def slot(self, ring_id: int, slot: int, slot_bytes: int) -> memoryview:
        ring = self._maps.get(ring_id)
        if ring is None:
            ring = self._maps[ring_id] = map_file(f"{self._prefix}ring{ring_id}")
        return memoryview(ring)[slot * slot_bytes:(slot + 1) * slot_bytes]
