"""A node's CPUs shared by the auto-tuned loaders on it: one small locked file in ``/dev/shm``.

Every ``workers="auto"`` loader of this user whose process has the same CPU budget (the
same affinity and cgroup quota: the ranks of one job on a node, a train and a validation
loader) writes one line into ``procpipe-node-u<uid>-<8 hex>-cpus`` in ``/dev/shm`` (in its
``shm_dir`` if it has one: ``node_directory``) (the hex: a hash of the affinity mask, the budget
and the pid namespace), about once a second:

    <key> <pid> <heartbeat> <want>

``want`` is the CPUs the loader would use for its workers: ``inf`` while its consumer
waits for batches (it could use more), about what its workers use now (plus headroom) when
the consumer is the bottleneck, and 0 between iterations. Each loader reads the others'
lines and takes its **share** of the node's budget by max-min fairness (water-filling):
every loader gets what it wants if the budget allows, and those that want more split the
rest equally. So 8 ranks on a 96-CPU node each grow to 12 CPUs, and a validation
loader that is not iterating takes nothing from the training loader.

Robust by construction; the file is soft state, rebuilt from the live loaders' heartbeats:

- Created ``0600`` with ``O_NOFOLLOW`` and used only if it is a regular file of this user,
  not readable by others (else the loader works alone, with its own budget).
- Updated under an exclusive ``flock``, taken without blocking: if another loader holds it
  (for microseconds), this round is skipped and the share stays as it was. The
  coordinator never waits on it.
- A line whose pid is gone (in this pid namespace), or whose heartbeat is older than
  ``STALE_S``, is dropped by whoever writes next; a malformed line too.
- The last loader to leave removes the file. A loader whose file was removed meanwhile
  (by a leaver, the reaper or the sweep) makes it again at its next heartbeat. The reaper
  drops a killed process's lines (``_core/reaper.py``), and the start-up sweep removes a
  file whose heartbeats are all stale (``_core/stale_files.py``), so nothing stays in ``shm_dir``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import math
import os
import re
import stat
import tempfile
import time
import uuid

from . import reaper

logger = logging.getLogger("procpipe")

NAME = re.compile(r"procpipe-node-u([0-9]+)-[0-9a-f]{8}-cpus\Z")
STALE_S = 10.0  # a line not refreshed for this long is dropped (its loader is gone or stopped)
HEARTBEAT_S = 1.0  # a loader rewrites its line at least this often
NODE_DIR = "/dev/shm"  # the node file's directory for loaders without an shm_dir (node_directory)
HEADROOM = 1.25  # a satisfied loader asks for this much more than it uses (so it can grow)
MAX_BYTES = 1 << 16  # a file larger than this is not procpipe's: it is refused


def node_directory() -> str:
    """Where the node file goes for loaders whose shared memory is anonymous (no ``shm_dir``): the
    one directory every process of the node knows, ``/dev/shm`` (a few hundred bytes), else the
    temporary directory."""
    return NODE_DIR if os.path.isdir(NODE_DIR) else tempfile.gettempdir()


def file_name(budget: int, uid: int | None = None) -> str:
    """The node file's name for processes with this CPU budget (and this affinity, pid namespace)."""
    try:
        mask = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        mask = "?"
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "?"
    digest = hashlib.sha1(f"{mask}|{budget}|{ns}".encode()).hexdigest()[:8]
    return f"procpipe-node-u{os.geteuid() if uid is None else uid}-{digest}-cpus"


def water_fill(budget: float, wants: dict[str, float]) -> dict[str, float]:
    """Max-min fair shares of ``budget``: each gets its want if it fits, the rest split equally."""
    shares: dict[str, float] = {}
    left, open_ = float(budget), dict(wants)
    while open_:
        fair = left / len(open_)
        small = {k: w for k, w in open_.items() if w <= fair}
        if not small:
            shares.update(dict.fromkeys(open_, fair))
            break
        for k, w in small.items():
            shares[k] = w
            left -= w
            del open_[k]
    return shares


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: it runs, as another user)
        return True
    return True


def parse(text: str, now: float) -> dict[str, tuple[int, float, float]]:
    """The live lines of a node file: ``key -> (pid, heartbeat, want)`` (stale, dead and malformed ones dropped)."""
    entries: dict[str, tuple[int, float, float]] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 4:
            continue
        try:
            pid, beat, want = int(fields[1]), float(fields[2]), float(fields[3])
        except ValueError:
            continue
        if pid <= 0 or not math.isfinite(beat) or now - beat > STALE_S or not want >= 0 or not _alive(pid):
            continue
        entries[fields[0]] = (pid, beat, want)
    return entries


def _render(entries: dict[str, tuple[int, float, float]]) -> bytes:
    return "".join(f"{k} {pid} {beat:.3f} {want:g}\n" for k, (pid, beat, want) in entries.items()).encode()


class NodeShare:
    """One loader's line in the node file (coordinator thread): ``update`` publishes what it
    wants and returns its share of ``budget``; ``leave`` removes the line (and the file, if last).

    ``budget``: this process's CPU budget (``core.cpus.cpu_budget``); ``directory``: ``shm_dir``, or
    ``node_directory()`` for a loader whose shared memory is anonymous. Never raises: where the file
    cannot be used, the share is the whole budget.
    """

    def __init__(self, directory: str, budget: int, key: str | None = None) -> None:
        self.path = os.path.join(directory, file_name(budget))
        self.budget = budget
        self.key = key or uuid.uuid4().hex[:12]
        self.share = float(budget)  # the last share computed (the whole budget until another loader shows up)
        self.peers = 1  # loaders in the file at the last update (this one included)
        self._fd: int | None = None
        self._last = -math.inf
        self._broken = False  # the file cannot be used: work alone

    def due(self, now: float | None = None) -> bool:
        """Whether a heartbeat is due (``update`` may be called sooner). ``now``: ``time.time()``."""
        return not self._broken and (time.time() if now is None else now) - self._last >= HEARTBEAT_S

    def update(self, want: float, now: float | None = None) -> float:
        """Write this loader's ``want`` (CPUs; ``math.inf``: as many as it can get) and return its share."""
        if self._broken:
            return self.share
        now = time.time() if now is None else now
        fd = self._locked()
        if fd is None:
            return self.share  # busy (another loader writes now) or unusable: the last share stands
        try:
            entries = parse(os.pread(fd, MAX_BYTES, 0).decode("ascii", "replace"), now)
            entries[self.key] = (os.getpid(), now, want)
            self._write(fd, entries)
            wants = {k: w for k, (_, _, w) in entries.items()}
            self.share = max(1.0, water_fill(self.budget, wants)[self.key])
            self.peers = len(entries)
            self._last = now
        except OSError:
            pass
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return self.share

    def leave(self) -> None:
        """Remove this loader's line; the last one out removes the file."""
        if self._broken or self._fd is None:
            self._close()
            return
        fd = self._locked()
        if fd is not None:
            try:
                entries = parse(os.pread(fd, MAX_BYTES, 0).decode("ascii", "replace"), time.time())
                entries.pop(self.key, None)
                if entries:
                    self._write(fd, entries)
                else:
                    os.unlink(self.path)  # (the same file: _locked checked it under the lock)
                    reaper.forget_node_file(self.path)
            except OSError:
                pass
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        self._close()

    # ---- the file
    @staticmethod
    def _write(fd: int, entries: dict[str, tuple[int, float, float]]) -> None:
        data = _render(entries)
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    def _close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _open(self) -> int | None:
        try:
            reaper.register_node_file(self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            self._give_up(f"cannot open it ({os.strerror(exc.errno or errno.EIO)})")
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size > MAX_BYTES:
            os.close(fd)
            self._give_up("it is not a file procpipe made (another owner, mode or size)")
            return None
        return fd

    def _locked(self) -> int | None:
        """The node file, open and exclusively locked (None: busy this round, or unusable).
        Reopened when the name now points elsewhere (the last loader removed it meanwhile)."""
        for _ in range(2):
            if self._fd is None:
                self._fd = self._open()
                if self._fd is None:
                    return None
            fd = self._fd
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return None  # another loader writes it now: not waited for
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except OSError:
                same = False
            if same:
                return fd
            fcntl.flock(fd, fcntl.LOCK_UN)
            self._close()  # removed (and perhaps made again): open the name anew
        return None

    def _give_up(self, why: str) -> None:
        self._broken = True
        logger.warning(
            "procpipe: workers='auto' will not share this node's CPUs with other loaders through %s: %s. "
            "Each loader tunes within this process's whole CPU budget (%d); pass shm_dir= a directory only "
            "you can write to, or AutoWorkers(max=...) per loader",
            self.path,
            why,
            self.budget,
        )
