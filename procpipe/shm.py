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
from typing import Any

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
    """A fixed number of equal slots in one shared file, and the consumer-side free list.

    A loader's ring can be replaced by a larger one (a *generation*: ``ring_id`` 0, 1, ...)
    when a batch outgrows its slots. Slot numbers are unique across generations: this
    ring's are ``first_slot .. first_slot + slots - 1``, so a slot number alone names its
    ring (``owns``). ``free`` holds the free slot numbers. A replaced ring is ``retired``:
    its slots are never handed out again, and it is removed once they are all back.
    """

    def __init__(self, files: SharedFiles, ring_id: int, slots: int, slot_bytes: int, first_slot: int = 0) -> None:
        self.ring_id = ring_id
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.first_slot = first_slot
        self.retired = False
        self.closed = False
        self.path = files.path(f"ring{ring_id}")
        what = f"{slots} ring slots of {_mib(slot_bytes)}"
        check_capacity(files.directory, slots * slot_bytes, what)
        create_file(self.path, slots * slot_bytes, what)
        self._map = map_file(self.path)
        self.nbytes = slots * slot_bytes
        probe = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(probe)  # where the ring is mapped in this process (CUDA registration)
        del probe
        self.free: deque[int] = deque(range(first_slot, first_slot + slots))
        # One exporter type per ring: its length is the slot size; ``ring`` finds the ring from a batch.
        self._lease_type = type("SlotLease", (ctypes.Array,),
                                {"_type_": ctypes.c_char, "_length_": slot_bytes, "ring": self})

    def owns(self, slot: int) -> bool:
        return self.first_slot <= slot < self.first_slot + self.slots

    @property
    def idle(self) -> bool:
        """Every slot is free: nothing is being written into the ring or read from it."""
        return len(self.free) == self.slots

    def close(self) -> None:
        """Unmap the ring now (and close its file descriptor) unless a batch still uses it;
        then it is unmapped when the last such batch dies."""
        self.closed = True
        try:
            self._map.close()
        except BufferError:
            pass

    def remove(self) -> None:
        """A retired ring whose slots are all back: its file goes now (its memory once unmapped)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.close()

    def lease(self, slot: int, on_release: Callable[[int], None]) -> ctypes.Array:
        """A per-batch object exporting slot ``slot``; ``on_release(slot)`` runs when it dies."""
        lease = self._lease_type.from_buffer(self._map, (slot - self.first_slot) * self.slot_bytes)
        weakref.finalize(lease, on_release, slot)
        return lease

    def exporter(self) -> ctypes.Array:
        """An object exporting the whole ring: while it lives the ring stays mapped (a CUDA
        registration holds one, so the memory is never unmapped while registered)."""
        return (ctypes.c_char * self.nbytes).from_buffer(self._map)


def ring_of(array: Any) -> Ring | None:
    """The ring a numpy array of a batch lives in (a view of one of its slots), or None."""
    base = array
    for _ in range(8):
        base = getattr(base, "base", None)
        if base is None:
            return None
        ring = getattr(type(base), "ring", None)
        if isinstance(ring, Ring):
            return ring
    return None


class WorkerRings:
    """A worker's view of the rings: maps each ring file the first time a task names it.

    Tasks arrive in the order they were sent, and after the coordinator replaced its ring
    it names only the new one: mapping a newer ring unmaps the older ones here.
    """

    def __init__(self, files_prefix: str) -> None:
        self._prefix = files_prefix
        self._maps: dict[int, mmap.mmap] = {}

    def slot(self, ring_id: int, slot: int, slot_bytes: int) -> memoryview:
        ring = self._maps.get(ring_id)
        if ring is None:
            for old in [i for i in self._maps if i < ring_id]:
                try:
                    self._maps[old].close()
                    del self._maps[old]
                except BufferError:  # still exported (cannot happen between tasks): keep it
                    pass
            ring = self._maps[ring_id] = map_file(f"{self._prefix}ring{ring_id}")
        return memoryview(ring)[slot * slot_bytes:(slot + 1) * slot_bytes]
