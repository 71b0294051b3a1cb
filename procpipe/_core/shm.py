"""Shared memory: the ring of reusable batch slots, and the files behind it.

Every file a loader creates is named ``procpipe-<pid>-<token>-<what>`` in one directory
(``/dev/shm`` by default), so the whole set can be removed by prefix: by ``close()``, by
garbage collection of the loader, or by a worker that notices its parent was killed.
Every file is created by ``open_new_file`` (owner-only, never an existing name, never
through a symlink, its space reserved) and reopened by ``open_owned`` (only if it is
still a regular 0600 file of this user). ``open_new_file`` registers each file with this
process's reaper first (reaper.py), which removes it if the process is killed, and
``remove_file`` tells the reaper it is gone; the first ``SharedFiles`` of a process in a
directory sweeps it of the files of dead processes (stale_files.py).

A slot is handed to the consumer as a *lease*: a small per-batch object that exports the
slot's bytes. Every array of the batch is a view whose ``.base`` is that object, so the
slot goes back to the free list exactly when the last array of the batch dies (a
``weakref.finalize`` on the lease), never earlier.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import mmap
import os
import secrets
import stat
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import psutil

from ..errors import SharedMemoryError
from . import reaper
from .stale_files import sweep_once

PAGE = mmap.PAGESIZE


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class SharedFiles:
    """Names and removes the files of one loader in its shared-memory directory."""

    def __init__(self, directory: str, prefix: str | None = None) -> None:
        """A new, unique set of names in ``directory``; or, given ``prefix``, an existing set
        (a worker removing the files of a loader that was killed).

        The first new set of a process in a directory sweeps it first: the files that dead
        processes of this user left there are removed, and a warning says so (stale_files.py)."""
        self.directory = directory
        if prefix is None:
            sweep_once(directory)
        self.prefix = prefix or os.path.join(
            os.path.abspath(directory),  # (absolute: a chdir changes nothing)
            f"procpipe-{os.getpid()}-{secrets.token_hex(4)}-",
        )

    @classmethod
    def from_prefix(cls, prefix: str) -> SharedFiles:
        return cls(os.path.dirname(prefix), prefix)

    def path(self, what: str) -> str:
        return self.prefix + what

    def remove_all(self) -> None:
        for path in glob.glob(glob.escape(self.prefix) + "*"):
            remove_file(path)


def remove_file(path: str) -> None:
    """Remove a file procpipe created (if still there), and tell the reaper it is gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    reaper.forget(path)


def check_capacity(directory: str, needed: int, what: str) -> None:
    """Fail early, with the fix, if ``directory`` cannot hold ``needed`` more bytes."""
    free = psutil.disk_usage(directory).free
    if needed > free:
        raise SharedMemoryError(
            f"procpipe needs {_mib(needed)} in {directory} for {what}, but only {_mib(free)} is free. "
            "Fixes: lower prefetch, workers or batch_size (the ring holds prefetch + 2*workers + 1 batches, "
            "or prefetch + 4*workers + 1 for batches up to 1 MiB; "
            "plus workers with speculate=, and 3 with device='cuda'); "
            "in Docker, start the container with a larger --shm-size (e.g. --shm-size=2g); "
            "or pass shm_dir='/path/on/a/larger/filesystem'."
        )


LARGE_RESERVATION_BYTES = 1 << 30  # a ring this large is mentioned when it is made


def is_large_reservation(needed: int, free: int) -> bool:
    """Whether reserving ``needed`` bytes where ``free`` are free deserves a word to the user:
    more than ``LARGE_RESERVATION_BYTES``, or more than a quarter of what is free."""
    return needed > LARGE_RESERVATION_BYTES or needed > free // 4


def warn_large_ring(directory: str, slots: int, slot_bytes: int) -> None:
    """Say (once per ring: a grown ring, a new generation, says it again) that the ring
    reserves a lot of ``directory``, and how to lower it."""
    needed, free = slots * slot_bytes, psutil.disk_usage(directory).free
    if is_large_reservation(needed, free):
        import warnings

        warnings.warn(
            f"procpipe: the ring reserves {_mib(needed)} of {directory} ({_mib(free)} free): {slots} slots "
            f"of {_mib(slot_bytes)} (a full batch), one for each batch that may be ready or in "
            "flight at once (prefetch + 2*workers + 1, or prefetch + 4*workers + 1 for batches up to 1 MiB; "
            "plus workers with speculate=, and 3 with device='cuda'). "
            "To lower it: a smaller prefetch, fewer workers, or a smaller batch_size.",
            stacklevel=2,
        )


def open_new_file(path: str, size: int, what: str, data: bytes = b"", unlinked: bool = False) -> int:
    """Create ``path`` for ``what`` and return its open (read-write) file descriptor.

    Every file procpipe creates goes through here: owner-only (mode 0600), and never an
    existing name (``O_CREAT | O_EXCL | O_NOFOLLOW``), so a symlink or file planted at the
    name is refused, not followed or overwritten. ``size`` bytes are reserved now, so a
    full filesystem fails here with ``SharedMemoryError`` (not with SIGBUS, or a raw
    ``ENOSPC``, later); ``data``, if given, is written at the start.

    The path is registered with this process's reaper before the file exists, so it is
    removed even if this process is killed a moment later (reaper.py); ``remove_file``
    unregisters it. ``unlinked``: the caller removes the name at once (it lives on as an
    open descriptor), so nothing is registered.
    """
    if not unlinked:
        reaper.register(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        reaper.forget(path)  # (someone else's file: never ours to remove)
        raise FileExistsError(
            errno.EEXIST,
            f"procpipe will not reuse or follow an existing file for {what}: something already "
            "exists at that fresh, random name (another process put it there, possibly a symlink). Remove it, "
            "and pass a shm_dir only you can write to",
            path,
        ) from None
    except BaseException:
        reaper.forget(path)
        raise
    if not unlinked:
        reaper.hold(path, fd)  # locked at once: the sweep never takes it for a dead process's
    try:
        if max(size, len(data)):
            os.posix_fallocate(fd, 0, max(size, len(data)))
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done : done + (1 << 30)], done)
    except OSError as exc:
        os.close(fd)
        remove_file(path)
        raise SharedMemoryError(
            f"procpipe could not reserve {_mib(max(size, len(data)))} in {os.path.dirname(path)} for {what}: {exc}. "
            "Free some space there, start Docker with a larger --shm-size, or pass shm_dir=... "
            "on a filesystem with room."
        ) from exc
    except BaseException:
        os.close(fd)
        remove_file(path)
        raise
    return fd


def create_file(path: str, size: int, what: str, data: bytes = b"") -> None:
    """``open_new_file``, closed: the file is created, reserved and written."""
    os.close(open_new_file(path, size, what, data))


def open_owned(path: str, flags: int = os.O_RDWR) -> int:
    """Open a file procpipe created (in this or the loader's process) and return its descriptor.

    Anything else is refused with ``PermissionError``: a symlink (never followed), something
    that is not a regular file, a file of another user, or one that others may read or write
    (procpipe creates its files 0600). So a worker never unpickles, maps or trusts a file
    that someone else put or changed in a shared directory.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise PermissionError(
            errno.EACCES, "procpipe will not follow a symlink where it expects its own file", path
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(
            errno.EACCES,
            f"procpipe will not use this file: it is not one procpipe created (expected a regular "
            f"file owned by uid {os.geteuid()} with mode 0600, found mode {stat.filemode(st.st_mode)} owned by "
            f"uid {st.st_uid}); something else replaced or changed it",
            path,
        )
    return fd


def check_private_dir(directory: str, name: str) -> None:
    """Refuse a directory where other users could replace procpipe's files: writable by
    group or others without the sticky bit (``/dev/shm`` and ``/tmp`` have it)."""
    mode = os.stat(directory).st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        raise ValueError(
            f"{name}={directory!r} can be written by other users ({stat.filemode(mode)}) and has no sticky bit, "
            "so they could replace the files procpipe shares with its workers. Pass a directory only you can "
            f"write to, or set its sticky bit (chmod +t {directory})."
        )


def map_file(path: str) -> mmap.mmap:
    """Map a whole shared file read-write, pages populated up front (procpipe's own files only: ``open_owned``)."""
    fd = open_owned(path)
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
        warn_large_ring(files.directory, slots, slot_bytes)
        create_file(self.path, slots * slot_bytes, what)
        self._map: mmap.mmap | None = map_file(self.path)
        self.nbytes = slots * slot_bytes
        probe = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(probe)  # where the ring is mapped in this process (CUDA registration)
        del probe
        self.free: deque[int] = deque(range(first_slot, first_slot + slots))
        # One exporter type per ring: its length is the slot size; ``ring_ref`` finds the ring
        # from a batch. A weak reference: the ring holds the type, and a strong one back would
        # make a cycle that keeps a closed ring's mapping alive until the cycle collector runs.
        self._lease_type = cast(
            "type[ctypes.Array[ctypes.c_char]]",
            type(
                "SlotLease",
                (ctypes.Array,),
                {
                    "_type_": ctypes.c_char,
                    "_length_": slot_bytes,
                    "ring_ref": weakref.ref(self),
                    "__del__": _end_lease,
                },
            ),
        )

    def owns(self, slot: int) -> bool:
        return self.first_slot <= slot < self.first_slot + self.slots

    @property
    def idle(self) -> bool:
        """Every slot is free: nothing is being written into the ring or read from it."""
        return len(self.free) == self.slots

    def close(self) -> None:
        """Unmap the ring now (and close its file descriptor) unless a batch still uses it;
        then it is unmapped when the last such batch dies (the ring lets go of its mapping
        here, so only the batches' exporters hold it)."""
        self.closed = True
        if self._map is None:
            return
        try:
            self._map.close()
        except BufferError:
            pass
        self._map = None

    def remove(self) -> None:
        """A retired ring whose slots are all back: its file goes now (its memory once unmapped)."""
        remove_file(self.path)
        self.close()

    def lease(self, slot: int, on_release: Callable[[int], None]) -> ctypes.Array:
        """A per-batch object exporting slot ``slot``; ``on_release(slot)`` runs when it dies."""
        lease: Any = self._lease_type.from_buffer(self._mapped(), (slot - self.first_slot) * self.slot_bytes)
        lease.slot, lease.on_release = slot, on_release  # (_end_lease: half the cost of a weakref.finalize)
        return lease

    def exporter(self) -> ctypes.Array:
        """An object exporting the whole ring: while it lives the ring stays mapped (a CUDA
        registration holds one, so the memory is never unmapped while registered)."""
        return (ctypes.c_char * self.nbytes).from_buffer(self._mapped())

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            raise ValueError(f"ring {self.path} is closed")
        return self._map


def _end_lease(lease: Any) -> None:
    """A slot lease's ``__del__``: the last array viewing the slot is gone, the slot goes back."""
    lease.on_release(lease.slot)


def ring_of(array: Any) -> Ring | None:
    """The ring a numpy array of a batch lives in (a view of one of its slots), or None."""
    base = array
    for _ in range(8):
        base = getattr(base, "base", None)
        if base is None:
            return None
        ref = getattr(type(base), "ring_ref", None)
        ring = ref() if isinstance(ref, weakref.ref) else None
        if isinstance(ring, Ring):
            return ring
    return None


class WorkerRings:
    """A worker's view of the rings: maps each ring file the first time a task names it.

    Tasks arrive in the order they were sent, and after the coordinator replaced its ring
    it names only the new one: mapping a newer ring unmaps the older ones here. One still
    exported (a view of it outlived its task, e.g. held by a traceback) is kept and tried
    again on every later call, so it is unmapped as soon as that view is gone.
    """

    def __init__(self, files_prefix: str) -> None:
        self._prefix = files_prefix
        self._maps: dict[int, mmap.mmap] = {}
        self._newest = -1

    def slot(self, ring_id: int, slot: int, slot_bytes: int) -> memoryview:
        self._newest = max(self._newest, ring_id)
        if len(self._maps) > 1 or (self._maps and ring_id not in self._maps):
            self._unmap_older(self._newest)
        ring = self._maps.get(ring_id)
        if ring is None:
            ring = self._maps[ring_id] = map_file(f"{self._prefix}ring{ring_id}")
        return memoryview(ring)[slot * slot_bytes : (slot + 1) * slot_bytes]

    def _unmap_older(self, ring_id: int) -> None:
        for old in [i for i in self._maps if i < ring_id]:
            try:
                self._maps[old].close()
            except BufferError:  # still exported: kept, and tried again on the next call
                continue
            del self._maps[old]

    def mapped(self) -> list[int]:
        """The ring generations mapped here."""
        return sorted(self._maps)
