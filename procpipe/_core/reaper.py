"""The reaper: removes this process's shared files by name once it is gone, however it ended.

Only what has a name needs it: a ring in ``shm_dir=``, a cache in a directory, the node file of
auto-tuned loaders. A loader's anonymous shared memory (the default, _core/shm.py) goes with its
last user by itself, so a process that makes no named file starts no reaper.

A loader removes its files on ``close()``, when it is garbage, at interpreter exit, and its
workers remove them when they see the training process die. None of that runs when the
training process is SIGKILLed (the OOM killer's way) while no worker is alive to notice:
its workers died in a failed epoch, are stopped (SIGSTOP), or are still starting. The
reaper covers every such case:

- One small process per training process, started once, the first time a file is made
  (``register``). It is a bare interpreter, ``python -S -I -c <REAPER_CODE>``: no site
  packages, no procpipe, no numpy (about 15 ms of CPU, started with ``posix_spawn``
  without waiting for it, and with ``SCHED_IDLE`` until it waits, so it takes no CPU from
  the workers starting at the same moment: it adds the spawn call to a loader's start-up).
  It runs in a session of its own (``setsid``) and ignores SIGINT, SIGTERM and SIGHUP, so
  Ctrl-C or a signal to the training job's process group does not end it first.
- The training process tells it each file's path before creating the file (``register``)
  and after removing it (``forget``), one message on a pipe each (a few per loader, none
  per batch). It knows nothing else and removes nothing else, but for the node files that
  auto-tuned loaders share (``_core/nodeshare.py``, ``register_node_file``): there it removes
  this process's lines, and the file once no live process's line is left.
- It waits for the training process to end (a pidfd where Linux has them, else it checks
  its parent every half second), then reads what is left on the pipe and removes every
  path it was told about that is still a regular file of this user: ``lstat`` (a symlink
  is never followed) and ``unlink`` (which removes a name, never a target). Then it exits.

Each registered file is also held open here with a shared ``flock``, released when this
process ends: the start-up sweep (``procpipe._core.stale_files``) takes a file whose lock is free
as one whose creator is gone, even from another pid namespace (a container sharing
``/dev/shm``) where its pid means nothing.

Forked children (workers) close the reaper's pipe and the locks at once
(``os.register_at_fork``): the reaper follows the training process only, and a child
stopped or stuck cannot keep a file "alive". If the reaper cannot start, procpipe says so
once (logger ``procpipe``): a killed training process's files then stay until the next loader's
start-up sweep (its workers end with it, by their death signal, before they could remove them).
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import threading

logger = logging.getLogger("procpipe")

REAPER_MARK = "procpipe-reaper"  # in the reaper's command line: how tools (and the tests) recognise it

# The reaper process's whole program (an interpreter started with -S -I runs it; stdin is the pipe).
REAPER_CODE = f"""# {REAPER_MARK}: removes the files its parent registered once the parent is gone
import fcntl, os, select, signal, stat, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
    signal.signal(s, signal.SIG_IGN)
parent, uid, paths, nodes, rest = int(sys.argv[1]), os.geteuid(), set(), set(), b""
os.chdir("/")  # (holds no directory busy; every path it is sent is absolute)
for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
    if int(fd) > 2:  # what the parent let children inherit (not close-on-exec): never held open here
        try:
            os.close(int(fd))
        except OSError:
            pass
try:  # started SCHED_IDLE (to take no CPU from starting workers): back to normal, to clean up at once
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
except (AttributeError, OSError):
    pass
try:
    pidfd = os.pidfd_open(parent)
except (AttributeError, OSError):
    pidfd = None
def take(data):
    global rest
    *records, rest = (rest + data).split(b"\\0")
    for r in records:
        kind, into = r[:1], nodes if r[:1] in (b"n", b"m") else paths
        (into.add if kind in (b"+", b"n") else into.discard)(r[1:])
def gone():
    return os.getppid() != parent
reading = True
while not gone():
    watch = ([0] if reading else []) + ([pidfd] if pidfd is not None else [])
    ready = select.select(watch, [], [], None if pidfd is not None else 0.5)[0]
    if pidfd is not None and pidfd in ready:
        break
    if 0 in ready:
        data = os.read(0, 65536)
        if data:
            take(data)
        else:
            reading = False
os.set_blocking(0, False)
while reading:
    try:
        data = os.read(0, 65536)
    except (BlockingIOError, OSError):
        break
    reading = bool(data)
    take(data)
for p in paths:
    try:
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            os.unlink(p)
    except OSError:
        pass
def live(line):  # a node file's line "<key> <pid> <heartbeat> <want>" of another live process
    f = line.split()
    return len(f) == 4 and f[1].isdigit() and int(f[1]) != parent and os.path.exists(b"/proc/" + f[1])
for p in nodes:  # shared files (_core/nodeshare.py): drop the parent's lines; the last one out removes it
    try:
        fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid and st.st_size < 65536:
                fcntl.flock(fd, fcntl.LOCK_EX)
                kept = [line for line in os.pread(fd, 65536, 0).split(b"\\n") if live(line)]
                if not kept and os.stat(p, follow_symlinks=False).st_ino == st.st_ino:
                    os.unlink(p)
                else:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, b"".join(line + b"\\n" for line in kept), 0)
        finally:
            os.close(fd)
    except OSError:
        pass
"""


_WITHOUT = (
    "if this process is killed while none of its workers runs, its files may stay in shm_dir until a "
    "loader started later removes them"
)


class _Client:
    """This process's side: the reaper's pid, the pipe to it, the registered paths and their locks."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.pid: int | None = None
        self.pipe: int | None = None  # write end, non-blocking
        self.pending = b""  # what the pipe could not take yet
        self.paths: set[bytes] = set()
        self.nodes: set[bytes] = set()  # shared node files (nodeshare.py): only this process's lines are removed
        self.locks: dict[bytes, int] = {}
        self.failed = False  # the reaper could not be started: said once, not tried again

    def start(self) -> None:
        """Start the reaper (again, after it died), and tell it every path registered so far."""
        if self.pid is not None:
            self._exited()  # a reaper that was killed: collected
        if self.pipe is not None:
            os.close(self.pipe)
        self.pid = self.pipe = None
        name = os.path.basename(sys.executable or "").lower()
        if "python" not in name and "pypy" not in name:  # embedded (uwsgi...): no interpreter to run it
            self.failed = True
            logger.warning(
                "procpipe could not start its cleanup process (sys.executable=%r is not a Python interpreter): %s",
                sys.executable,
                _WITHOUT,
            )
            return
        read, write = os.pipe()  # (both not inherited: the reaper gets the read end as its stdin)
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            argv = [sys.executable, "-S", "-I", "-c", REAPER_CODE, str(os.getpid())]
            self.pid = os.posix_spawn(
                sys.executable,
                argv,
                os.environ,
                setsid=True,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, read, 0),
                    (os.POSIX_SPAWN_DUP2, devnull, 1),
                    (os.POSIX_SPAWN_DUP2, devnull, 2),
                ],
            )
        except (OSError, ValueError, AttributeError) as exc:
            os.close(write)
            self.failed = True
            logger.warning("procpipe could not start its cleanup process (%s): %s", exc, _WITHOUT)
            return
        finally:
            os.close(read)
            os.close(devnull)
        try:  # SCHED_IDLE while it starts: its interpreter's start-up takes no CPU from the workers
            os.sched_setscheduler(self.pid, os.SCHED_IDLE, os.sched_param(0))  # starting now (REAPER_CODE)
        except (AttributeError, OSError):
            pass
        os.set_blocking(write, False)
        self.pipe = write
        self.pending = b"".join(b"+" + p + b"\0" for p in self.paths) + b"".join(b"n" + p + b"\0" for p in self.nodes)

    def _exited(self) -> bool:
        """The reaper has ended (killed: it never ends on its own while this process runs)."""
        try:
            return self.pid is not None and os.waitpid(self.pid, os.WNOHANG)[0] != 0
        except ChildProcessError:  # collected already (by the user's os.wait()?): gone too
            return True

    def send(self, message: bytes) -> None:
        if self.failed:
            return
        if self.pipe is None or self._exited():
            self.start()
            if self.pipe is None:
                return
        self.pending += message
        try:
            while self.pending:
                self.pending = self.pending[os.write(self.pipe, self.pending) :]
        except BlockingIOError:
            pass  # the reaper is still starting and the pipe is full: sent with the next message
        except BrokenPipeError:
            self.start()  # the reaper was killed: a new one, told everything again
            if self.pipe is not None and self.pending:
                try:
                    self.pending = self.pending[os.write(self.pipe, self.pending) :]
                except OSError:
                    pass


_lock = threading.Lock()
_client: _Client | None = None


def _current() -> _Client:
    global _client  # noqa: PLW0603 - one reaper client per process (re-made after a fork)
    if _client is None or _client.owner != os.getpid():
        _client = _Client()
    return _client


def register(path: str) -> None:
    """``path`` is about to be created by this process: the reaper removes it if this process
    ends while it still exists. Call before creating the file (no window where it is unknown)."""
    name = os.fsencode(os.path.abspath(path))  # (the reaper works from /; this process may chdir)
    with _lock:
        client = _current()
        if name not in client.paths:
            client.paths.add(name)
            client.send(b"+" + name + b"\0")


def hold(path: str, fd: int) -> None:
    """The registered file ``path`` was created as ``fd``: keep a shared lock on it
    while it exists, the sign that its creator is alive (see the sweep)."""
    name = os.fsencode(os.path.abspath(path))  # (the reaper works from /; this process may chdir)
    try:
        lock = os.dup(fd)  # (dup is close-on-exec: a spawned process never holds it)
        fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return
    with _lock:
        old = _current().locks.pop(name, None)
        _current().locks[name] = lock
    if old is not None:
        os.close(old)


def forget(path: str) -> None:
    """``path`` was removed (or never created): the reaper no longer needs to remove it."""
    name = os.fsencode(os.path.abspath(path))  # (the reaper works from /; this process may chdir)
    with _lock:
        client = _current()
        lock = client.locks.pop(name, None)
        if name in client.paths:
            client.paths.discard(name)
            client.send(b"-" + name + b"\0")
    if lock is not None:
        os.close(lock)


def register_node_file(path: str) -> None:
    """This process writes lines into the shared node file ``path`` (_core/nodeshare.py): once
    this process is gone, the reaper removes its lines, and the file if no live process's remain."""
    name = os.fsencode(os.path.abspath(path))
    with _lock:
        client = _current()
        if name not in client.nodes:
            client.nodes.add(name)
            client.send(b"n" + name + b"\0")


def forget_node_file(path: str) -> None:
    """This process left the node file ``path`` (its lines are gone, or the file)."""
    name = os.fsencode(os.path.abspath(path))
    with _lock:
        client = _current()
        if name in client.nodes:
            client.nodes.discard(name)
            client.send(b"m" + name + b"\0")


def reaper_pid() -> int | None:
    """The pid of this process's reaper, once started (None before the first file, or if it could not start)."""
    client = _client
    return client.pid if client is not None and client.owner == os.getpid() else None


def _after_fork_in_child() -> None:
    """A forked child is not the training process: it drops the pipe and the locks (its
    parent keeps them), so the reaper and the sweep follow the parent alone."""
    global _client, _lock  # noqa: PLW0603 - the per-process state, dropped in a forked child
    _lock = threading.Lock()  # (another thread may have held it at the fork)
    client, _client = _client, None
    if client is None:
        return
    for fd in [client.pipe, *client.locks.values()]:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


os.register_at_fork(after_in_child=_after_fork_in_child)
