"""Worker pools: where the coordinator's tasks run. One interface, two kinds of pool.

The coordinator (coordinator.py) knows workers only as ``WorkerLink`` objects: where a
``Task`` goes (``put``/``flush``, never blocking), where replies come from (``read``, when
``reply_fd`` is readable) and how their end is seen (``exit_fd`` becomes readable). A
``WorkerPool`` starts a link for a worker index (``start``), stops them all (``stop``), and
says whether its workers write into the coordinator's ring (``uses_ring``). The pool knows
no epochs, batches or order: those are the coordinator's.

- ``LocalPool`` (this module): worker processes on this machine (_worker/process.py), one duplex
  pipe each (a Unix socket pair: a ring's descriptor travels on it, ``map_ring``), their
  ``(task, index)`` status words in shared memory (so a death or a ``task_timeout`` names the
  sample), batches written straight into the coordinator's ring.
- ``procpipe.ray.RayPool``: agents on Ray nodes, each running local worker processes and
  a ring of its own; batches come back through Ray's object store.

``Watchdog`` marks straggling workers (``speculate=``) and kills stuck ones
(``task_timeout=``); ``kill_tree`` ends a stuck worker and anything it started.
"""

from __future__ import annotations

import gc
import itertools
import os
import statistics
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from typing import TYPE_CHECKING, Any, cast

import psutil
from multiprocess.connection import wait as wait_ready

from .._core import wire
from .._core.messages import STOP, BatchDone, BatchFailed, MapRing, Reply, SamplesSkipped
from .._core.rings import Ring
from .._core.shm import Segments, SharedFd, close_fd, map_fd
from .._core.stats import WorkerCounters
from .._worker.process import ABANDON_SIGNAL, STARTING, STATUS_STRIDE, worker_main
from .._worker.spec_shipping import ShippedSpec
from .._worker.worker_spec import WorkerSpec
from .replies import unreadable_reply

if TYPE_CHECKING:
    from .attempts import Attempt

_SPECULATE_MIN_S = 0.02  # never call a batch a straggler before it has run this long
_SPECULATE_AFTER = 5  # batches that must have finished before their median is trusted
_DURATIONS_KEPT = 64  # the running median covers this many recent batches

_STATUS_WORDS = STATUS_STRIDE // 8  # int64 words from one worker's status to the next
_started: weakref.WeakSet = weakref.WeakSet()  # the worker processes this process started


def _disown_workers() -> None:
    """In a child made by ``os.fork()``: the workers are its parent's, not its children.

    multiprocess lists the processes it started in a module-level set that a forked child
    inherits; at the child's exit (``sys.exit``) its exit handler would SIGTERM every
    daemon in that set, the parent's workers included, then fail to join them. The
    loader's own shutdown is guarded separately (``Coordinator.close``).
    """
    from multiprocess import process

    children = getattr(process, "_children", None)  # private to multiprocess; absent: nothing to do
    if children is not None:
        children.difference_update(list(_started))
    _started.clear()


os.register_at_fork(after_in_child=_disown_workers)


class WorkerLink(ABC):
    """One worker as the coordinator sees it: the attempts it holds, its health, its transport.

    The bookkeeping (``tasks`` in the order the worker runs them, straggling, killed after
    ``task_timeout``, dead past the restart budget, retired by autotune) is the
    coordinator's and the same for every pool; the transport methods are the pool's.
    """

    def __init__(self, index: int, counters: WorkerCounters) -> None:
        self.index = index
        self.counters = counters
        self.tasks: dict[int, Attempt] = {}  # in the order the worker runs them
        self.fatal: str | None = None
        self.stalled = False  # its running task is a straggler (speculate): give it no more work
        self.killed_for: Attempt | None = None  # the attempt it was running when killed after task_timeout
        self.dead = False  # died past max_worker_restarts; replaced when the next epoch starts
        self.retiring = False  # autotune: no more tasks; told to stop once idle
        self.stop_sent = False
        self.writing = False  # the coordinator's selector watches write_fd() for room
        self.ps: Any = None  # its psutil.Process, where it is local (autotune reads its CPU time)
        self.ready = False  # it has loaded the dataset and functions: its tasks' time runs

    @property
    def healthy(self) -> bool:
        """Neither straggling, nor killed, nor dead: a batch it runs needs no copy elsewhere."""
        return not (self.stalled or self.killed_for or self.dead)

    @property
    def usable(self) -> bool:
        """It may be given new tasks (it may be busy): not failed to start, killed, dead or retiring."""
        return not (self.fatal or self.killed_for or self.dead or self.retiring)

    def stop_if_idle(self) -> None:
        """A retiring worker with nothing left to run is told to stop (once)."""
        if self.retiring and not self.tasks and not self.stop_sent:
            self.stop_sent = True
            self.put(STOP)  # it exits; its exit_fd fires and the coordinator removes it

    # ---- transport: the pool's
    @property
    @abstractmethod
    def pid(self) -> int | None:
        """Its process id, where it is a process of this machine (None otherwise)."""

    @property
    def process(self) -> Any:
        """Its ``multiprocess.Process`` where it is local, else None."""
        return None

    @property
    @abstractmethod
    def exitcode(self) -> int | None:
        """How it ended (negative: killed by that signal), once it has."""

    @abstractmethod
    def describe(self) -> str:
        """``_worker 3 (pid 1234)``: how messages name it."""

    def map_ring(self, ring: Ring) -> None:  # noqa: B027 - an optional hook: a worker that maps no ring of ours
        """Make sure the worker can map ``ring`` before a task names it (a local worker is sent its
        segment, once); a remote worker writes into rings of its own."""

    @abstractmethod
    def reply_fd(self) -> int:
        """A descriptor that is readable when replies wait (``read``)."""

    @abstractmethod
    def exit_fd(self) -> int:
        """A descriptor that becomes readable once the worker is gone."""

    @abstractmethod
    def read(self) -> list[Reply] | None:
        """The replies waiting now, decoded; None once the channel is closed."""

    @abstractmethod
    def put(self, message: Any) -> None:
        """Queue a ``Task`` (or ``STOP``); ``flush`` sends it."""

    @abstractmethod
    def flush(self) -> bool:
        """Send what can go now without blocking; True once nothing waits."""

    @abstractmethod
    def write_fd(self) -> int:
        """A descriptor that is writable when ``flush`` can send more."""

    @abstractmethod
    def reap(self) -> None:
        """After ``exit_fd`` fired: collect the process and close the channel."""

    @abstractmethod
    def kill(self) -> None:
        """End it now (``task_timeout``); ``exit_fd`` fires when it is gone."""

    @abstractmethod
    def stuck_on(self, attempt: Attempt) -> int | None:
        """The index it was loading for ``attempt`` when it ended, if known (-1: collating)."""

    @abstractmethod
    def failed_to_start(self) -> bool:
        """It ended with an error before it reached any user code (restarting would fail alike)."""

    @property
    def counts_as_restart(self) -> bool:
        """Whether its death counts against ``max_worker_restarts`` (a remote pool's lost
        node counts against its own budget instead)."""
        return True


class WorkerPool(ABC):
    """Starts and stops worker links; the coordinator decides how many and which index."""

    uses_ring: bool = True  # workers write batches into the coordinator's ring (same machine)
    tasks_per_worker: int | None = None  # tasks a worker holds at once; None: the coordinator's choice

    @abstractmethod
    def start(self, index: int, counters: WorkerCounters) -> WorkerLink:
        """Start worker ``index`` (a replacement keeps the index); must not block for long."""

    @abstractmethod
    def stop(self, links: list[WorkerLink]) -> None:
        """Stop every link (the loader closes): never blocks for more than a few seconds."""

    def sample_memory(self, links: list[WorkerLink]) -> None:  # noqa: B027 - an optional hook: nothing to do unless a pool overrides it
        """Record each live worker's resident size, where it can be read."""

    def admit(self, batch_bytes: int, in_flight: int) -> None:  # noqa: B027 - an optional hook: nothing to do unless a pool overrides it
        """The first batch is ``batch_bytes``; at most ``in_flight`` are outstanding: raise
        if the pool cannot hold that many (a remote object store), naming the fix."""

    def close(self) -> None:  # noqa: B027 - an optional hook: nothing to do unless a pool overrides it
        """Release what the pool itself holds (after ``stop``)."""

    def info(self) -> dict[str, Any] | None:
        """``stats()["backend"]``: None for local workers; a remote pool describes its agents."""
        return None


class LocalWorker(WorkerLink):
    """A worker process on this machine, with a duplex pipe to it."""

    def __init__(self, index: int, process: Any, conn: Any, counters: WorkerCounters, status: Any) -> None:
        super().__init__(index, counters)
        self._process = process
        self.conn = conn
        self.outbox = wire.Outbox(conn)  # messages its pipe has not taken yet (never a blocking write)
        self._reply_fd = conn.fileno()  # kept: a closed pipe has none, and the selector knows it by this
        # Every reply waiting, in one read (not a poll and two reads per reply, as recv_bytes).
        self.inbox = wire.Inbox(conn)
        self._status = status  # the pool's status words
        self._rings_sent: set[int] = set()  # the ring generations sent to it (map_ring)
        self._pid = process.pid  # kept: a closed process (reap) has none to give
        self._exitcode: int | None = None  # how it ended, kept by reap
        self.reaped = False  # reap collected it: its process object is closed, its descriptors too

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def process(self) -> Any:
        return None if self.reaped else self._process

    @property
    def exitcode(self) -> int | None:
        return self._exitcode if self.reaped else self._process.exitcode

    def describe(self) -> str:
        return f"worker {self.index} (pid {self._pid})"

    def map_ring(self, ring: Ring) -> None:
        if ring.ring_id not in self._rings_sent:
            self._rings_sent.add(ring.ring_id)
            self.outbox.put(MapRing(ring.ring_id, ring.nbytes), (ring.fd,))

    def reply_fd(self) -> int:
        return self._reply_fd

    def exit_fd(self) -> int:
        return self._process.sentinel

    def read(self) -> list[Reply] | None:
        """Read the replies waiting on the pipe, never blocking.

        A reply that does not unpickle here (a sample's ``__reduce__`` that fails in this
        process) becomes the error of its batch instead of stopping the coordinator.
        """
        replies: list[Reply] = []
        finished = 0  # replies that end a task, read so far: the next one is for the task after them
        inbox = self.inbox
        if self.conn.closed:
            return None
        for data in inbox.receive():
            try:
                reply = wire.decode(data)
            except Exception as exc:  # noqa: BLE001 - user objects' unpickling: anything can be raised
                # A worker replies to its tasks in order: this is the task after those finished above.
                attempt = next(itertools.islice(self.tasks.values(), finished, None), None)
                if attempt is None:
                    continue
                skipped = [r for r in replies if isinstance(r, SamplesSkipped) and r.task_id == attempt.id]
                left_out = {info.index for r in skipped for info in r.samples} | {
                    info.index for info in attempt.skipped or ()
                }
                kept = [i for i in attempt.job.payload if i not in left_out]
                reply = unreadable_reply(attempt.id, self.index, data, exc, kept)
            if isinstance(reply, (BatchDone, BatchFailed)):
                finished += 1
            replies.append(reply)
        return replies or (None if inbox.closed else replies)

    def put(self, message: Any) -> None:
        self.outbox.put(message)

    def flush(self) -> bool:
        return self.outbox.flush()

    def write_fd(self) -> int:
        return self.outbox.fileno()

    def reap(self) -> None:
        """Collect the dead process, close the pipe, and close the process object: its own two
        descriptors (the pipe multiprocess watches its end by) are otherwise released only
        when the object is garbage, which a reference cycle or a disabled GC postpones. (Its
        replacement is a new process: ``Loader.worker_processes`` lists the live ones.)"""
        self.outbox.close()
        self.inbox.close()
        self.conn.close()
        if self.reaped:
            return
        process = self._process
        process.join(0.1)
        if process.exitcode is None:
            return  # (still running: its descriptors go with the object)
        self._exitcode = process.exitcode
        process.close()
        self.reaped = True

    def kill(self) -> None:
        kill_tree(self._pid, wait=False)

    def stuck_on(self, attempt: Attempt) -> int | None:
        word = _STATUS_WORDS * self.index
        task_id, index = self._status[word], self._status[word + 1]
        return index if task_id == attempt.id else None

    def failed_to_start(self) -> bool:
        return self._status[_STATUS_WORDS * self.index] == STARTING and (self.exitcode or 0) > 0


class LocalPool(WorkerPool):
    """Worker processes on this machine, all alike but for their index (_worker/process.py).

    ``capacity``: the most workers at once (their status words are sized for it).
    """

    def __init__(
        self,
        ctx: Any,
        spec: WorkerSpec | ShippedSpec,
        segments: Segments,
        leftovers: tuple[str, ...],
        env: dict[str, str],
        capacity: int,
        own_session: bool = False,
    ) -> None:
        self.ctx = ctx
        self.own_session = own_session  # each worker in a session of its own (process.worker_main)
        self.spec = spec  # the WorkerSpec (fork), or its pickle in shared memory (other starts)
        self.leftovers = leftovers  # the prefixes of the loader's named files (process.worker_main)
        self.env = env  # worker_env: set on top of this process's environment in each worker
        me = psutil.Process()
        self.parent = (me.pid, me.create_time())  # a worker that sees this process gone cleans up and exits
        nbytes = STATUS_STRIDE * capacity
        fd = segments.new("status", nbytes, "the workers' status words", "fewer workers", anonymous=True)
        self._status_fd = SharedFd(fd)
        self._status_map = map_fd(self._status_fd.fd, nbytes)
        self._status = memoryview(self._status_map).cast("q")  # (task id, index) per worker

    def start(self, index: int, counters: WorkerCounters) -> LocalWorker:
        self._status[_STATUS_WORDS * index] = STARTING  # the worker clears it once started (_worker/process.py)
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        process = self.ctx.Process(
            target=worker_main,
            args=(
                index,
                child_conn,
                self.spec,
                self._status_fd,
                self.leftovers,
                *self.parent,
                {**os.environ, **self.env},
                self.own_session,
            ),
            name=f"procpipe-worker-{index}",
            daemon=True,
        )
        # A forked worker's first garbage collection would walk (and so copy, page by
        # page) the whole inherited heap: ~12k page faults and 0.1-0.3 s before its
        # first batch in a process that imported torch. Frozen objects are left out.
        # gc.unfreeze() unfreezes everything, so where the user froze objects of their
        # own (gc.get_freeze_count() > 0) procpipe neither freezes nor unfreezes.
        freeze = self.ctx.get_start_method() == "fork" and gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            process.start()
        finally:
            if freeze:
                gc.unfreeze()  # this process collects as before
        _started.add(process)
        child_conn.close()
        counters.rss_bytes = 0  # a new process: not sampled yet (not its predecessor's figure)
        return LocalWorker(index, process, parent_conn, counters, self._status)

    def stop(self, links: list[WorkerLink]) -> None:
        stop_all(cast("list[LocalWorker]", links))  # the links this pool made (start): LocalWorkers

    def sample_memory(self, links: list[WorkerLink]) -> None:
        sample_memory(links)

    def close(self) -> None:
        self._status.release()
        self._status_map.close()
        close_fd(self._status_fd.fd)


class Watchdog:
    """``speculate=`` and ``task_timeout=``: which workers straggle, which are stuck.

    A worker straggles once its running task has taken ``speculate`` times the median
    of the recent batches (``finished``); it gets no more work until it replies. A worker
    whose running task passes ``task_timeout`` is killed, and remembers the attempt.
    """

    def __init__(self, speculate: float | None, timeout: float | None) -> None:
        self.speculate = speculate
        self.timeout = timeout
        self._durations: deque[float] = deque(maxlen=_DURATIONS_KEPT)  # recent batches' busy time

    def finished(self, busy: float) -> None:
        """A batch took ``busy`` seconds in its worker."""
        self._durations.append(busy)

    def look(self, workers: list[WorkerLink], now: float, longest: float) -> float:
        """Mark straggling workers, kill those stuck past task_timeout; seconds until the next look."""
        timeout = self.timeout
        threshold = None
        if self.speculate is not None and len(self._durations) >= _SPECULATE_AFTER:
            threshold = max(self.speculate * statistics.median(self._durations), _SPECULATE_MIN_S)
        wait = longest
        for w in workers:
            if not w.tasks or w.killed_for or w.dead or not w.ready:
                continue  # (a worker still starting is not running its first task yet)
            head = next(iter(w.tasks.values()))
            if head.started is None:
                head.started = now
            running = now - head.started
            if timeout is not None:
                if running >= timeout:
                    w.killed_for = head
                    w.kill()  # its exit_fd fires: the coordinator re-runs its tasks
                    continue
                wait = min(wait, timeout - running)
            if threshold is not None and not w.stalled:
                if running >= threshold:
                    w.stalled = True
                else:
                    wait = min(wait, threshold - running)
        return max(wait, 0.001)


def sample_memory(workers: list[WorkerLink]) -> None:
    """Record each live worker's resident size, and its peak."""
    for w in workers:
        if w.dead or w.pid is None:
            continue
        try:
            rss = psutil.Process(w.pid).memory_info().rss
        except (psutil.Error, TypeError):
            continue
        w.counters.rss_bytes = rss
        w.counters.peak_rss_bytes = max(w.counters.peak_rss_bytes, rss)


def kill_tree(pid: int, wait: bool = True) -> None:
    """SIGKILL a worker and anything it started (``wait``: until they are gone, 1 s at most)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if wait:
        psutil.wait_procs(procs, timeout=1.0)


def stop_all(workers: list[LocalWorker]) -> None:
    """Ask every worker to stop, give them 2 s together, kill what is left, close the pipes.

    A busy worker is also sent ``ABANDON_SIGNAL``: it leaves its current task and those
    queued in its pipe, so that closing (or exiting after a Ctrl-C) does not wait for them.

    Never blocks on a pipe: tasks not yet sent are dropped, and a worker that does not
    read its stop message (busy in a sample) is killed at the deadline. Meanwhile their
    replies are read and dropped: a worker blocked writing a large reply (an inline batch,
    before the ring exists) could not otherwise see the stop.
    """
    workers = [w for w in workers if not w.reaped]  # (a dead one kept till the next epoch is collected)
    for w in workers:
        w.outbox.drop_unsent()
        w.outbox.put(STOP)
        w.outbox.flush()
        if w.tasks:  # busy: its batches are not wanted, and tasks already in its pipe come before the stop
            try:
                os.kill(w.process.pid, ABANDON_SIGNAL)  # (it leaves them: _worker/process.py)
            except (ProcessLookupError, TypeError):
                pass
    deadline = time.monotonic() + 2.0
    running = {w.process.sentinel: w for w in workers}
    replies = {w.inbox.fileno(): w.inbox for w in workers if not w.conn.closed and not w.inbox.closed}
    while running and (left := deadline - time.monotonic()) > 0:
        writing = [w for w in workers if w.outbox.pending and not w.outbox.flush()]
        # a worker still reading the rest of a task gets it (then its stop message) as it reads
        for ready in wait_ready([*running, *replies], min(left, 0.01) if writing else left):
            if ready in running:
                del running[ready]
                continue
            inbox = replies[ready]
            inbox.receive()  # (dropped)
            if inbox.closed:
                del replies[ready]
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            kill_tree(w.process.pid)
        w.process.join(1.0)
        w.outbox.close()
        w.inbox.close()
        w.conn.close()  # (its process object stays open: code watching worker_processes may hold it)
