"""The start-up sweep: remove procpipe files that a dead process of this user left in shm_dir.

Only what has a name can be left behind: a loader's shared memory is anonymous unless it is
given ``shm_dir=`` (its ring's files), a cache directory (``cache="/a/dir"``), and the node file
auto-tuned loaders share; earlier versions of procpipe also kept their status words, spec and
module lists in ``/dev/shm`` (``KINDS`` still names them, so an upgrade cleans up after them).
The reaper (``procpipe._core.reaper``) removes a killed process's files. What it cannot cover
(a reaper killed together with its process, say by a cgroup's OOM kill, files from a
version of procpipe without a reaper, a reboot of a disk-backed ``shm_dir``) is found here:
the first ``Segments`` of a process in a directory sweeps it once (``sweep_once``; for the node
file's directory, the first auto-tuned loader), and says what it removed in one warning line
(logger ``procpipe``): the count, the bytes and the pids.

A file is removed only when all of these hold:

- its name is one procpipe gives (``NAME``: ``procpipe-<pid>-<8 hex>-<kind>``, where
  ``<kind>`` is one of ``KINDS``), and it is a regular file of this user (``lstat``: a
  symlink is never followed, nor removed; another user's file is left alone, even as root);
- no process holds its lock (a creator keeps a shared ``flock`` on each file while it exists,
  reaper.py): this also protects a live process in another pid namespace (a container
  sharing ``/dev/shm``), whose pid means nothing here;
- it is older than ``SETTLE_S`` (its last change): a file just created is locked a few
  microseconds later, never swept in between;
- its creator is gone: no process runs with its pid, or the one that does started after
  the file last changed (the pid was reused), or is a zombie.

The node file that auto-tuned loaders share (``procpipe-node-u<uid>-<8 hex>-cpus``,
``_core/nodeshare.py``) has no single creator: it is removed when it is this user's regular
file, unchanged for ``nodeshare.STALE_S`` (every live loader rewrites it each second),
not locked at the moment, and none of its lines is a live loader's.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field

import psutil

from . import nodeshare

logger = logging.getLogger("procpipe")

# What procpipe names in a directory: ring files (shm_dir=), a cache file (there, or in a cache
# directory), a Records file with shm_dir= (unlinked as soon as it is made); and what earlier
# versions named there too.
KINDS = ("ring[0-9]+", "cache", "records", "status", "spec", "preload", "cachefile")
NAME = re.compile(r"procpipe-([0-9]+)-[0-9a-f]{8}-(?:" + "|".join(KINDS) + r")\Z")
SETTLE_S = 2.0  # a file changed this recently is never swept
_START_SLACK_S = 2.0  # a process's start time is known to about a second (boot time in whole seconds)

_swept: set[tuple[int, str]] = set()  # (pid, directory): swept by this process already
_swept_lock = threading.Lock()


@dataclass
class Swept:
    """What a sweep removed: ``paths``, their total ``nbytes``, and the ``pids`` that made them."""

    paths: list[str] = field(default_factory=list)
    nbytes: int = 0
    pids: set[int] = field(default_factory=set)


def sweep_once(directory: str) -> Swept | None:
    """Sweep ``directory`` if this process has not yet (None if it has); warn about what was removed."""
    key = (os.getpid(), os.path.realpath(directory))
    with _swept_lock:
        if key in _swept:
            return None
        _swept.add(key)
    swept = sweep(directory)
    if swept.paths:
        logger.warning(
            "procpipe removed %d file(s) (%.1f MiB) from %s left by process(es) %s that ended without "
            "cleaning up (killed, or an older procpipe)",
            len(swept.paths),
            swept.nbytes / 2**20,
            directory,
            ", ".join(map(str, sorted(swept.pids))) or "that shared a node file",
        )
    return swept


def sweep(directory: str, settle_s: float = SETTLE_S) -> Swept:
    """Remove the files in ``directory`` that a gone process of this user left (module doc)."""
    swept = Swept()
    try:
        names = os.listdir(directory)
    except OSError:
        return swept
    me, uid, now = os.getpid(), os.geteuid(), time.time()
    starts: dict[int, float | None] = {}  # pid -> its process's start time (None: none runs), looked up once
    for name in names:
        node = nodeshare.NAME.match(name)
        if node is not None and int(node.group(1)) == uid:
            _stale_node_file(os.path.join(directory, name), uid, now, swept)  # (no single creator's pid)
            continue
        match = NAME.match(name)
        if match is None or int(match.group(1)) == me:
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or now - st.st_mtime < settle_s:
            continue
        pid = int(match.group(1))
        if pid not in starts:
            starts[pid] = _process_start(pid)
        started = starts[pid]
        if started is not None and started <= st.st_mtime + _START_SLACK_S:
            continue  # its creator may run: the process with that pid is older than the file's last change
        if _locked(path, st):  # a process holds it: alive (in another pid namespace, say)
            continue
        try:
            os.unlink(path)  # (the name: if swapped for a symlink meanwhile, the link, never its target)
        except OSError:
            continue
        swept.paths.append(path)
        swept.nbytes += st.st_blocks * 512
        swept.pids.add(pid)
    return swept


def _stale_node_file(path: str, uid: int, now: float, swept: Swept) -> bool:
    """Remove the node file ``path`` if no live loader uses it (module doc); whether it was removed."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or now - st.st_mtime < nodeshare.STALE_S:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a loader writes it now: alive
        if nodeshare.parse(os.pread(fd, nodeshare.MAX_BYTES, 0).decode("ascii", "replace"), now):
            return False
        if os.stat(path, follow_symlinks=False).st_ino != st.st_ino:
            return False
        os.unlink(path)
        swept.paths.append(path)
        swept.nbytes += st.st_blocks * 512
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None if none runs (or a zombie).

    Read from ``/proc/<pid>/stat`` (a few microseconds; psutil where there is no such file)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()  # (after the command name, which may hold anything)
        if fields[0] == b"Z":
            return None
        return psutil.boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else _psutil_start(pid)
    except (OSError, IndexError, ValueError):
        return _psutil_start(pid)


def _psutil_start(pid: int) -> float | None:
    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:  # (access denied: another user's process; it runs, since when is unknown)
        return float("-inf")


def _locked(path: str, st: os.stat_result) -> bool:
    """Whether a process holds the file's lock (its creator, alive); True when unsure."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return True  # replaced since it was looked at: leave it
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:  # EWOULDBLOCK: held; anything else: unsure, so held too
        return True
    finally:
        os.close(fd)  # (closing releases the lock taken above)
