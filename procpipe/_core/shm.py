"""Shared memory: where every byte procpipe shares between processes comes from, and how it goes.

**Anonymous by default.** A loader's ring, its workers' status words, its shipped dataset and
functions, a ``cache="memory"``, ``procpipe.Records`` and the torch facade's replica snapshots
are *memfds* (``memfd_create``): shared memory with no name in any directory, so no
``/dev/shm`` size limits it (a container's default 64 MB included), and nothing is left behind
however a process ends: the kernel frees the memory with the last descriptor or mapping of
it. Each is named ``procpipe-<pid>-<token>-<what>`` for ``/proc/<pid>/maps`` and ``lsof``
(``/memfd:procpipe-... (deleted)``). Memory itself is the limit: what a segment needs is held
against the memory cgroup's room and the machine's available memory before it is made
(``memory_budget.py``), and reserved at once (``fallocate``), so too little memory is a
``SharedMemoryError`` that names the limit and the fixes, never a SIGBUS or an OOM kill later.

**Workers get descriptors, never names.** A ``SharedFd`` travels to a worker as it starts: inherited
across ``fork``, passed by multiprocess (``SCM_RIGHTS`` through a forkserver or the zygote, kept
open across ``exec`` for spawn) when it is an argument of the worker process, or inside the
pickled ``WorkerSpec`` (``shipping``/``receiving``: the descriptors go beside the pickle, as
arguments). A ring made later (the first batch sizes it; a batch that outgrows it makes a new
generation) goes to each worker over its pipe (``wire.Outbox``, ``SCM_RIGHTS``). Fixed-size
segments are sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW``), so no
process can truncate one under a reader (the SIGBUS of a truncated mapping); the shipped spec is
sealed against writes too.

**Named files where asked.** ``Loader(shm_dir=...)`` keeps the ring in files of that directory (a
hugepages mount, a disk), and ``cache="/a/dir"`` keeps the cache there: ``Segments`` with a
directory. Every file is named ``procpipe-<pid>-<token>-<what>``, created by ``open_new_file``
(owner-only, never an existing name, never through a symlink, its space reserved) and reopened by
``open_owned`` (only if still a regular 0600 file of this user); ``open_new_file`` registers each
with this process's reaper (reaper.py), which removes it if the process is killed, and the first
``Segments`` of a process in a directory sweeps it of dead processes' files (stale_files.py).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psutil

from ..errors import SharedMemoryError
from . import reaper
from .memory_budget import format_bytes, memory_budget
from .stale_files import sweep_once

#: Every array procpipe lays out in shared memory (a ring slot, the cache, Records) starts on a
#: multiple of this: a cache line, and the alignment numpy, torch and TensorFlow adopt without a copy.
ALIGN = 64


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return -(-n // ALIGN) * ALIGN


PAGE = mmap.PAGESIZE
MEMORY_RESERVE = 0.10  # the share of the memory budget a new segment leaves for everything else
RING_FIXES = (
    "lower prefetch, workers or batch_size (the ring holds prefetch + 2*workers + 1 batches, or "
    "prefetch + 4*workers + 1 for batches up to 1 MiB; plus workers with speculate=, and 3 with device='cuda')"
)


# ---------------------------------------------------------------------------- descriptors to workers
_shipping = threading.local()  # .table: the descriptors of the SharedFds pickled into a spec now (a list)


class SharedFd:
    """An open descriptor of procpipe's shared memory, that travels to worker processes.

    It stays a plain number in this process and in a forked child (which inherits it). Pickled
    as an argument of a starting worker process, multiprocess passes the descriptor itself
    (``DupFd``); pickled into a worker's spec (``shipping``), it is put in a table that goes
    beside the pickle, and the worker's unpickling (``receiving``) takes it from there. Anywhere
    else a descriptor means nothing, and pickling one is an error.
    """

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        table = getattr(_shipping, "table", None)
        if table is not None:
            table.append(self)
            return _shipped, (len(table) - 1,)
        from multiprocess import context, reduction

        if context.get_spawning_popen() is None:
            raise TypeError(
                "procpipe's shared memory can only be sent to a procpipe worker process as it starts "
                "(it is a descriptor, meaningless in another process)"
            )
        return _received, (reduction.DupFd(self.fd),)

    def __repr__(self) -> str:
        return f"SharedFd({self.fd})"


def _received(dup: Any) -> SharedFd:
    return SharedFd(dup.detach())


def _shipped(i: int) -> SharedFd:
    table = getattr(_shipping, "table", None)
    if table is None or i >= len(table):
        raise RuntimeError("procpipe: a shared-memory descriptor of the worker spec did not arrive with it")
    return table[i]


@contextmanager
def shipping() -> Iterator[list[SharedFd]]:
    """While pickling a worker spec: the ``SharedFd``s pickled go into the list yielded (in order),
    for the worker process to receive as arguments (``receiving``)."""
    table: list[SharedFd] = []
    _shipping.table = table
    try:
        yield table
    finally:
        _shipping.table = None


@contextmanager
def receiving(table: list[SharedFd]) -> Iterator[None]:
    """While unpickling a worker spec in the worker: its ``SharedFd``s are those of ``table``."""
    _shipping.table = table
    try:
        yield
    finally:
        _shipping.table = None


def close_fd(fd: int) -> None:
    """Close ``fd``, which may already be closed (the last step of a cleanup)."""
    try:
        os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------- room, before making
def check_memory(needed: int, what: str, fixes: str) -> None:
    """``SharedMemoryError`` naming the limit and the fixes, unless ``needed`` more bytes of
    memory fit this process's budget (memory_budget.py) with ``MEMORY_RESERVE`` of it left over."""
    budget = memory_budget()
    if needed <= budget.available * (1 - MEMORY_RESERVE):
        return
    raise SharedMemoryError(
        f"procpipe needs {format_bytes(needed)} of memory for {what}, but {budget.limit} leaves "
        f"{format_bytes(budget.available)}, and procpipe keeps {MEMORY_RESERVE:.0%} of that for the rest of the "
        f"program. Fixes: {fixes}; or give the process more memory (a container's limit: docker run --memory, "
        "a Kubernetes pod's resources.limits.memory)."
    )


def check_capacity(directory: str, needed: int, what: str, fixes: str = RING_FIXES) -> None:
    """Fail early, with the fixes, if ``directory`` cannot hold ``needed`` more bytes."""
    free = psutil.disk_usage(directory).free
    if needed > free:
        raise SharedMemoryError(
            f"procpipe needs {format_bytes(needed)} in {directory} for {what}, but only {format_bytes(free)} is "
            f"free. Fixes: {fixes}; or pass shm_dir= a directory on a larger filesystem, or leave shm_dir out "
            "(anonymous shared memory, limited by memory only)."
        )


def room(directory: str | None) -> tuple[int, str]:
    """``(bytes, where)``: the room a new segment has, and where that is (words for a message):
    the memory budget for anonymous memory, the free space of ``directory`` for files."""
    if directory is None:
        budget = memory_budget()
        return budget.available, budget.limit
    free = psutil.disk_usage(directory).free
    return free, f"{directory} ({format_bytes(free)} free)"


# ---------------------------------------------------------------------------- making segments
_SEALED_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0)
_SEALED_SIZE = _SEALED_SHRINK | getattr(fcntl, "F_SEAL_GROW", 0)
_SEALED_WRITES = getattr(fcntl, "F_SEAL_WRITE", 0)


def new_memory(name: str, size: int, what: str, fixes: str, data: bytes = b"", seal: int = _SEALED_SIZE) -> int:
    """An anonymous segment (a memfd named ``name``) of ``size`` bytes for ``what``, checked
    against the memory budget and reserved; ``data`` written at its start; ``seal``: the seals
    added (by default its size is fixed; 0: it may grow, as a growing cache). Its descriptor
    (read-write, close-on-exec)."""
    nbytes = max(size, len(data))
    check_memory(nbytes, what, fixes)
    try:
        fd = os.memfd_create(name[:249], os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
    except (AttributeError, OSError) as exc:
        raise SharedMemoryError(
            f"procpipe cannot make anonymous shared memory for {what} here (memfd_create: {exc}). "
            "Pass shm_dir='/dev/shm' (or another directory) to keep it in files there."
        ) from exc
    try:
        _reserve_and_write(fd, nbytes, data, what, "memory")
        if seal:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seal)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reserve_and_write(fd: int, nbytes: int, data: bytes, what: str, where: str) -> None:
    """Reserve ``nbytes`` of ``fd`` (a full filesystem or memory fails here, not with SIGBUS
    later), then write ``data`` at its start."""
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done : done + (1 << 30)], done)
    except OSError as exc:
        raise SharedMemoryError(
            f"procpipe could not reserve {format_bytes(nbytes)} of {where} for {what}: {exc}. Free some memory "
            "or space, or pass shm_dir= a directory on a filesystem with room."
        ) from exc


def seal_writes(fd: int) -> None:
    """Make an anonymous segment read-only for good (the shipped spec: no worker can change it)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALED_WRITES | fcntl.F_SEAL_SEAL)


class Segments:
    """Where a loader's shared memory comes from: anonymous memory, or files in ``directory``.

    ``Segments()`` (``shm_dir`` left out): each ``new`` segment is a memfd, and nothing needs
    removing. ``Segments(directory)``: each is a file named ``<prefix><what>`` there; the first
    ``Segments`` of a process in a directory sweeps it of dead processes' files (stale_files.py).
    ``remove_all`` removes every file of the set and closes the descriptors it ``hold``s (those of
    segments no other object owns: the shipped spec). ``prefix``: an existing set (a worker
    removing the files of a loader that was killed).
    """

    def __init__(self, directory: str | None = None, prefix: str | None = None) -> None:
        self.directory = directory
        self.token = f"procpipe-{os.getpid()}-{secrets.token_hex(4)}-"  # every segment's name begins so
        self.prefix: str | None = None  # the files' common path (named files only)
        self._held: list[int] = []
        if directory is not None:
            if prefix is None:
                sweep_once(directory)
            self.prefix = prefix or os.path.join(os.path.abspath(directory), self.token)  # (a chdir changes nothing)

    @property
    def named(self) -> bool:
        """Its segments are files in a directory (``shm_dir=``), not anonymous memory."""
        return self.directory is not None

    @classmethod
    def from_prefix(cls, prefix: str) -> Segments:
        return cls(os.path.dirname(prefix), prefix)

    def path(self, what: str) -> str:
        """The file of segment ``what`` (named segments only)."""
        if self.prefix is None:
            raise ValueError("anonymous shared memory has no file names")
        return self.prefix + what

    def new(
        self,
        what: str,
        size: int,
        description: str,
        fixes: str = RING_FIXES,
        data: bytes = b"",
        anonymous: bool = False,
        growing: bool = False,
    ) -> int:
        """A new segment ``what`` of ``size`` bytes, reserved (``description`` and ``fixes`` go into
        the error if there is no room); its descriptor (read-write, close-on-exec). ``anonymous``:
        in memory even where the set's segments are files (what workers only need for their lives:
        their status words, the shipped spec). ``growing``: it may grow (a stream's cache); anonymous
        memory never shrinks, and is fixed in size unless growing."""
        if self.directory is None or anonymous:
            seal = _SEALED_SHRINK if growing else _SEALED_SIZE
            return new_memory(self.token + what, size, description, fixes, data, seal)
        check_capacity(self.directory, max(size, len(data)), description, fixes)
        return open_new_file(self.path(what), size, description, data)

    def remove(self, what: str) -> None:
        """Segment ``what`` is no longer needed: its file goes (anonymous memory goes with its last user)."""
        if self.prefix is not None:
            remove_file(self.prefix + what)

    def hold(self, fd: int) -> None:
        """Keep ``fd`` open until ``remove_all``."""
        self._held.append(fd)

    def remove_all(self) -> None:
        held, self._held = self._held, []
        for fd in held:
            close_fd(fd)
        if self.prefix is not None:
            for path in glob.glob(glob.escape(self.prefix) + "*"):
                remove_file(path)


def map_fd(fd: int, size: int | None = None, populate: bool = True, writable: bool = True) -> mmap.mmap:
    """Map ``size`` bytes of ``fd`` (all of it by default) shared, its pages populated up front
    unless ``populate`` is False."""
    if size is None:
        size = os.fstat(fd).st_size
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))


# ---------------------------------------------------------------------------- another process's segment
def proc_address(fd: int) -> tuple[int, int, int, int]:
    """``(pid, fd, device, inode)``: how another process of this user opens this process's segment
    ``fd`` while it is open here (``open_proc_address``), the identity checked."""
    st = os.fstat(fd)
    return os.getpid(), fd, st.st_dev, st.st_ino


def open_proc_address(address: Sequence[int | str], flags: int = os.O_RDONLY) -> int:
    """Open the segment ``proc_address`` gave, through ``/proc/<pid>/fd/<fd>``; ``FileNotFoundError``
    if that process no longer holds it (it exited or closed it, or the number now holds another file)."""
    pid, owner_fd, dev, ino = (int(x) for x in address)
    fd = os.open(f"/proc/{pid}/fd/{owner_fd}", flags | os.O_CLOEXEC)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (dev, ino) or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise FileNotFoundError(errno.ENOENT, "not the shared memory it was", f"/proc/{pid}/fd/{owner_fd}")
    return fd


# ---------------------------------------------------------------------------- named files, safely
def remove_file(path: str) -> None:
    """Remove a file procpipe created (if still there), and tell the reaper it is gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    reaper.forget(path)


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
        _reserve_and_write(fd, max(size, len(data)), data, what, os.path.dirname(path))
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
        return map_fd(fd)
    finally:
        os.close(fd)
