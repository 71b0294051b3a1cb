"""The worker process: run the user's Python on a batch of indices, collate into a slot.

A worker receives small task tuples on its own pipe, produces every sample of the batch
(``fn(source[i])``), writes the collated arrays straight into the ring slot the task
names, and replies with the batch's layout (a few hundred bytes). Nothing large is
pickled unless the batch does not fit its slot.

Messages (messages.py): in, a ``Task`` (``slot = -1`` meaning "no slot: send the arrays
inline"), a ``MapRing`` (a ring's shared memory, its descriptor with it) or ``STOP``; out, per
task, ``SamplesSkipped`` (``on_error="skip"``) before a ``BatchDone``, or a ``BatchFailed``;
``WorkerFatal`` when the worker cannot start at all.

Each worker also keeps two int64s in the loader's status words up to date: the task id
and the index it is loading (-1 between samples), so that when a worker dies or is killed
for ``task_timeout``, the coordinator can name the sample it was stuck on. The coordinator
sets the task id to ``STARTING`` before it starts a worker process, and the worker sets it
to -1 once it has loaded the dataset: a worker that dies still ``STARTING`` never got as
far as the user's code (its process failed while starting, e.g. importing the main script).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import dill

from .._core import collate, wire
from .._core.messages import (
    STOP,
    BatchDone,
    BatchFailed,
    ErrorInfo,
    MapRing,
    SamplesSkipped,
    Task,
    WorkerFatal,
    WorkerReady,
)
from .._core.rings import WorkerRings
from .._core.rng import SampleScope
from .._core.shm import SharedFd, close_fd, map_fd
from .identity import enter_worker
from .produce import made_in, produce
from .spec_shipping import ShippedSpec, load_spec
from .start_method import leave_forkserver
from .worker_spec import WorkerSpec

_IDLE_CHECK_S = 0.25  # how often an idle worker checks that its parent is still alive
_EXIT_GRACE_S = 1.0  # after its parent died, how long a worker busy in user code gets to exit

STARTING = -2  # the task id in a worker's status words until its process has started (module doc)
# Bytes between two workers' status words: a cache line each. Packed, the workers, which write
# the index they load before every sample, would each take the line from the other's core.
STATUS_STRIDE = 64
ABANDON_SIGNAL = signal.SIGUSR1  # from a closing loader: leave the task at hand and those queued, exit now


class _ParentWatch:
    """Tells whether the loader's process is gone (it may have been SIGKILLed)."""

    def __init__(self, parent_pid: int, parent_started: float) -> None:
        self.pid = parent_pid
        self.started = parent_started

    def gone(self) -> bool:
        import psutil

        try:
            process = psutil.Process(self.pid)
            return process.create_time() != self.started or process.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the loader's process has ended, at most ``timeout`` seconds (None: no limit).

        Returns whether it has ended. Uses a pidfd where Linux has them, else polling.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            while not self.gone():
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                time.sleep(_IDLE_CHECK_S)
            return True
        try:
            if self.gone():  # (the pid may have been reused before the pidfd was opened)
                return True
            select.select([fd], [], [], None if deadline is None else max(0.0, deadline - time.monotonic()))
            return self.gone()
        finally:
            os.close(fd)


def _remove_files(leftovers: tuple[str, ...]) -> None:
    """The named files a killed loader left (its ring in ``shm_dir``, a cache in a directory): every
    file of each prefix of ``leftovers`` (its anonymous memory goes with its last user)."""
    from .._core.shm import Segments

    for prefix in leftovers:
        Segments.from_prefix(prefix).remove_all()


def _exit_with_parent(parent: _ParentWatch, leftovers: tuple[str, ...]) -> None:
    """Watchdog thread: when the loader's process dies, remove its named files and end this worker.

    It works even while the main thread is deep in user code, and where no death signal comes
    (``_die_with_parent``: a Ray agent's workers, in sessions of their own, have none). SIGTERM
    makes the main thread exit normally; a main thread stuck in native code, or swallowing
    SystemExit, is ended after a grace period. (A stopped worker runs no thread at all: its
    death signal, SIGKILL, ends it.)
    """
    parent.wait()
    _remove_files(leftovers)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_EXIT_GRACE_S)
    os._exit(1)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its parent process ends (best effort).

    SIGKILL, not SIGTERM: a stopped worker (SIGSTOP, a debugger, a scheduler's suspend) keeps
    any other signal pending, and cannot run its watch thread (``_exit_with_parent``) either;
    SIGKILL ends it all the same. Its parent is the training process (fork), or the zygote or
    forkserver that forked it, which exits when the training process does (``leave_forkserver``).
    The files are the training process's reaper's to remove (_core/reaper.py)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _abandon(signum: int, frame: Any) -> None:
    """``ABANDON_SIGNAL``: the loader is closing and wants none of this worker's batches (pool.stop_all)."""
    raise SystemExit(0)


def worker_main(
    worker_id: int,
    conn: Any,
    spec: WorkerSpec | ShippedSpec,
    status: SharedFd,
    leftovers: tuple[str, ...],
    parent_pid: int,
    parent_started: float,
    env: dict[str, str],
    own_session: bool = False,
) -> None:
    """Entry point of a worker process; ``env`` is its whole environment (pool.LocalPool).

    ``spec``: the ``WorkerSpec`` itself (forked) or a ``ShippedSpec``; ``status``: the pool's
    status words (module doc); ``leftovers``: the prefixes of the loader's named files, removed
    here if the loader is killed (none where its shared memory is anonymous, the default).

    ``own_session``: start a session of its own, out of its parent's process group. A Ray
    agent's workers need it: Ray kills a dead actor's whole process group at once, and a
    worker killed so could not remove its agent's files; in a session of its own it sees the
    agent gone, removes them, and exits (procpipe.ray)."""
    enter_worker(worker_id)  # (adapters ask identity.worker_index(), never the process's name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(ABANDON_SIGNAL, _abandon)
    # A signal mask is inherited (fork and exec): a training process started with SIGTERM or
    # SIGUSR1 blocked (by its launcher, or a thread that blocked them) must not hold back a
    # closing loader's ABANDON_SIGNAL or the parent's death signal in its workers.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, ABANDON_SIGNAL})
    if own_session:  # (and no death signal from its parent process: Ray kills an agent's forkserver
        os.setsid()  # before the agent itself; the watch below follows the agent)
    else:
        _die_with_parent()
    leave_forkserver()  # (nor does it keep the zygote or a forkserver alive)
    # The whole environment, not an update: a forkserver keeps the environment it started
    # with (the first loader's worker_env), which must not leak into another loader's workers.
    os.environ.clear()
    os.environ.update(env)
    parent = _ParentWatch(parent_pid, parent_started)
    pipe_closed = terminated = False
    threading.Thread(
        target=_exit_with_parent, args=(parent, leftovers), name="procpipe-parent-watch", daemon=True
    ).start()
    try:
        try:
            loaded = load_spec(spec)
        except BaseException:  # noqa: BLE001 - the user's spec failing to load, however: the parent is told why
            wire.send(conn, WorkerFatal(traceback.format_exc()))
            return
        status_words = _status_view(status, worker_id)
        status_words[0] = -1  # started: no longer STARTING
        wire.send(conn, WorkerReady(os.getpid()))
        _serve(conn, loaded, WorkerRings(), parent, status_words)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pipe_closed = True  # the loader closed our pipe, or died
    except SystemExit as exc:
        # SIGTERM: most often from the watch thread, a loader having been killed (_exit_with_parent),
        # possibly while it is still exiting. The watch thread removes its files then, but it is a
        # daemon: this thread's exit would cut it short (some files removed, not all).
        terminated = exc.code == 128 + signal.SIGTERM
        raise
    finally:
        # A loader that was killed closes our pipe (or signals us) while it is still exiting
        # (not yet a zombie): give its death a moment before deciding whether it is gone.
        if parent.wait(timeout=_EXIT_GRACE_S if pipe_closed or terminated else 0.0):
            # The loader was killed before it could clean up: remove its named files.
            _remove_files(leftovers)


def _status_view(status: SharedFd, worker_id: int) -> Any:
    """This worker's ``(task id, index)`` pair in the pool's status words (see the module doc)."""
    start = STATUS_STRIDE * worker_id
    try:
        mapped = map_fd(status.fd, start + STATUS_STRIDE)
    except OSError:
        return [-1, -1]
    finally:
        close_fd(status.fd)  # (this process's copy: the mapping keeps the memory)
    return memoryview(mapped)[start : start + 16].cast("q")


def _serve(conn: Any, spec: WorkerSpec, rings: WorkerRings, parent: _ParentWatch, status: Any) -> None:
    # The tasks queued in the pipe, read at once (small batches keep several queued): a
    # system call per few tasks, not a poll and two reads each (Connection.poll and recv_bytes).
    inbox = wire.Inbox(conn, with_fds=True)  # (a MapRing's descriptor comes with it)
    try:
        _serve_tasks(conn, spec, rings, parent, status, inbox)
    finally:
        inbox.close()  # (its own socket: left to the garbage collector, an exiting worker warns of it)


def _serve_tasks(
    conn: Any, spec: WorkerSpec, rings: WorkerRings, parent: _ParentWatch, status: Any, inbox: Any
) -> None:
    scope = SampleScope(spec.seed, seed_globals=spec.seed_globals)
    waiting = select.poll()
    waiting.register(inbox.fileno(), select.POLLIN)
    idle_ms = int(_IDLE_CHECK_S * 1000)
    queued: deque[bytes] = deque()
    samples_made_in = made_in(spec)  # (what an unsendable value's error names as the place to fix it)
    while True:
        while not queued:
            if inbox.closed:
                raise EOFError
            if waiting.poll(idle_ms):  # (a closed pipe shows too: receive then says so)
                queued.extend(inbox.receive())
            elif parent.gone():
                return
        task = wire.decode(queued.popleft())
        if task is STOP:
            return
        if type(task) is MapRing:
            rings.add(task.ring_id, inbox.fds.popleft(), task.nbytes)
            continue
        reply = run_task(spec, scope, rings, task, status, lambda skipped: wire.send(conn, skipped))
        conn.send_bytes(encode_reply(reply, task, samples_made_in))


def encode_reply(reply: BatchDone | BatchFailed, task: Task, made_in: str = "fn") -> bytes:
    """``reply`` for the wire; a batch holding a value that cannot be pickled (a generator, a
    lock, a socket...) becomes that batch's error, naming the value, rather than ending the
    worker: the consumer gets it from its ``next()``, as any other error of ``fn``."""
    try:
        return wire.encode(reply)
    except Exception as exc:
        if not isinstance(reply, BatchDone) or reply.layout is None:
            raise
        error = _unsendable(reply.layout, task.payload, exc, made_in)
        return wire.encode(BatchFailed(task.id, error, reply.busy_s))


def _refuses_pickle(value: Any) -> bool:
    try:
        wire.encode_value(value)
    except Exception:  # noqa: BLE001 - a user value's pickling can raise anything: that is the answer
        return True
    return False


def _unsendable(layout: list, payload: Any, exc: Exception, made_in: str) -> ErrorInfo:
    """The error of a batch whose layout cannot be pickled: which field, of which index, of what type
    (``made_in``: where the samples are made, ``produce.made_in``)."""
    found = collate.find_inline(layout, _refuses_pickle)
    if found is None:  # (only the whole batch fails to pickle: say so without a field)
        where, index, value = "the batch", None, None
    else:
        path, position, value = found
        if not isinstance(payload, list) and path[:1] == (1,):  # a stream's block layout: (info, records)
            path = path[1:]
        indices = payload if isinstance(payload, list) else None
        index = indices[position] if indices is not None and position is not None else None
        where = collate.describe_path(path) + (f" of index {index}" if index is not None else "")
    return _error_info(index, collate.unsendable_error(where, value, exc, made_in))


def run_task(
    spec: WorkerSpec,
    scope: SampleScope,
    rings: WorkerRings,
    task: Task,
    status: Any,
    send_skipped: Callable[[SamplesSkipped], None],
) -> BatchDone | BatchFailed:
    """One task, start to end: its batch in its slot (or inline), or the error of user code.

    ``send_skipped`` receives the samples left out (``on_error="skip"``)
    before the reply is returned. A ``SystemExit`` (``sys.exit()`` in ``fn``, or SIGTERM)
    propagates: the worker ends.
    """
    started = time.perf_counter()
    status[0] = task.id
    buffer = None
    try:
        buffer = rings.slot(task.ring_id, task.slot, task.slot_bytes) if task.slot >= 0 else None
        batch = produce(spec, scope, task.epoch, task.payload, buffer, task.slot_bytes, status)
        if batch.skipped:
            send_skipped(SamplesSkipped(task.id, [_error_info(i, exc) for i, exc in batch.skipped]))
            for _, error in batch.skipped:  # sent: their tracebacks (a cycle through produce's frame,
                error.__traceback__ = None  # which holds the ring view) are let go of now, not at a gc
        return BatchDone(task.id, batch.layout, batch.nbytes, batch.in_slot, time.perf_counter() - started)
    except BaseException as exc:  # a BaseException subclass from fn keeps its type too, as with workers=0
        if isinstance(exc, SystemExit):
            raise  # sys.exit() in fn, or SIGTERM (_raise_exit): the worker ends
        index = scope.index
        scope.leave()
        return BatchFailed(task.id, _error_info(index, exc), time.perf_counter() - started)
    finally:
        buffer = None  # a view of the ring, even when fn raised: an old ring is unmapped only once none is left


def _error_info(index: int | tuple[int, ...] | None, exc: BaseException) -> ErrorInfo:
    """An exception, as faults.rebuild_error rebuilds it."""
    try:
        exc_bytes = dill.dumps(exc, protocol=dill.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - a user exception may not pickle, however: its type name and message go
        exc_bytes = None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ErrorInfo(index, exc_bytes, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb)
