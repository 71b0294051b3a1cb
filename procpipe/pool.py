"""The worker processes, as the coordinator sees them: start, watch, stop.

A ``Launcher`` starts one worker process (worker.py) with a duplex pipe to it; the
coordinator registers the pipe and the process's sentinel in its selector, so a reply
and a death each wake it. ``WorkerHandle`` is what the coordinator knows of one worker:
its pipe, the attempts it holds (in the order it runs them), and its health (straggling,
killed after ``task_timeout``, dead past the restart budget, retired by autotune).

``Watchdog`` marks straggling workers (``speculate=``) and kills stuck ones
(``task_timeout=``); the coordinator then copies or re-runs their batches.
``sample_memory`` reads the workers' resident sizes for ``stats()`` and autotune;
``kill_tree`` ends a stuck worker and anything it started; ``stop_all`` ends them all
when the loader closes.
"""
from __future__ import annotations

import gc
import os
import statistics
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil
from multiprocess.connection import wait as wait_ready

from . import wire
from .stats import WorkerCounters
from .worker import worker_main

if TYPE_CHECKING:
    from .epochs import Attempt

_SPECULATE_MIN_S = 0.02  # never call a batch a straggler before it has run this long
_SPECULATE_AFTER = 5  # batches that must have finished before their median is trusted
_DURATIONS_KEPT = 64  # the running median covers this many recent batches

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


@dataclass(eq=False)
class WorkerHandle:
    """One worker process: its pipe, the attempts it holds, and its health."""

    index: int
    process: Any
    conn: Any
    counters: WorkerCounters
    tasks: dict[int, Attempt] = field(default_factory=dict)  # in the order the worker runs them
    fatal: str | None = None
    stalled: bool = False  # its running task is a straggler (speculate): give it no more work
    killed_for: Attempt | None = None  # the attempt it was running when killed after task_timeout
    dead: bool = False  # died past max_worker_restarts; replaced when the next epoch starts
    retiring: bool = False  # autotune: no more tasks; told to stop once idle
    stop_sent: bool = False
    ps: Any = None  # its psutil.Process (autotune reads its CPU time)
    outbox: wire.Outbox | None = None  # messages to it not yet taken by its pipe (never a blocking write)
    writing: bool = False  # the coordinator's selector watches its outbox for writability

    @property
    def healthy(self) -> bool:
        """Neither straggling, nor killed, nor dead: a batch it runs needs no copy elsewhere."""
        return not (self.stalled or self.killed_for or self.dead)

    def stop_if_idle(self) -> None:
        """A retiring worker with nothing left to run is told to stop (once)."""
        if self.retiring and not self.tasks and not self.stop_sent:
            self.stop_sent = True
            self.outbox.put(None)  # it exits; its sentinel fires and the coordinator removes it


class Launcher:
    """Starts worker processes, all alike but for their index."""

    def __init__(self, ctx: Any, spec: Any, prefix: str, env: dict[str, str]) -> None:
        self.ctx = ctx
        self.spec = spec  # a WorkerSpec (fork) or the path of its pickle (other starts)
        self.prefix = prefix  # of the loader's shared files
        self.env = env  # worker_env: set on top of this process's environment in each worker
        me = psutil.Process()
        self.parent = (me.pid, me.create_time())  # a worker that sees this process gone cleans up and exits

    def start(self, index: int, counters: WorkerCounters) -> WorkerHandle:
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        process = self.ctx.Process(
            target=worker_main,
            args=(index, child_conn, self.spec, self.prefix, *self.parent, {**os.environ, **self.env}),
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
        return WorkerHandle(index, process, parent_conn, counters, outbox=wire.Outbox(parent_conn))


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

    def look(self, workers: list[WorkerHandle], now: float, longest: float) -> float:
        """Mark straggling workers, kill those stuck past task_timeout; seconds until the next look."""
        timeout = self.timeout
        threshold = None
        if self.speculate is not None and len(self._durations) >= _SPECULATE_AFTER:
            threshold = max(self.speculate * statistics.median(self._durations), _SPECULATE_MIN_S)
        wait = longest
        for w in workers:
            if not w.tasks or w.killed_for or w.dead:
                continue
            head = next(iter(w.tasks.values()))
            if head.started is None:
                head.started = now
            running = now - head.started
            if timeout is not None:
                if running >= timeout:
                    w.killed_for = head
                    kill_tree(w.process.pid, wait=False)  # its sentinel fires: the coordinator re-runs its tasks
                    continue
                wait = min(wait, timeout - running)
            if threshold is not None and not w.stalled:
                if running >= threshold:
                    w.stalled = True
                else:
                    wait = min(wait, threshold - running)
        return max(wait, 0.001)


def sample_memory(workers: list[WorkerHandle]) -> None:
    """Record each live worker's resident size, and its peak."""
    for w in workers:
        if w.dead:
            continue
        try:
            rss = psutil.Process(w.process.pid).memory_info().rss
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


def stop_all(workers: list[WorkerHandle]) -> None:
    """Ask every worker to stop, give them 2 s together, kill what is left, close the pipes.

    Never blocks on a pipe: tasks not yet sent are dropped, and a worker that does not
    read its stop message (busy in a sample) is killed at the deadline. Meanwhile their
    replies are read and dropped: a worker blocked writing a large reply (an inline batch,
    before the ring exists) could not otherwise see the stop.
    """
    for w in workers:
        w.outbox.drop_unsent()
        w.outbox.put(None)
        w.outbox.flush()
    deadline = time.monotonic() + 2.0
    running = {w.process.sentinel: w for w in workers}
    replies = {w.conn: w for w in workers if not w.conn.closed}
    while running and (left := deadline - time.monotonic()) > 0:
        writing = [w for w in workers if w.outbox.pending and not w.outbox.flush()]
        # a worker still reading the rest of a task gets it (then its stop message) as it reads
        for ready in wait_ready([*running, *replies], min(left, 0.01) if writing else left):
            if ready in running:
                del running[ready]
                continue
            try:
                ready.recv_bytes()
            except (EOFError, OSError):
                del replies[ready]
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            kill_tree(w.process.pid)
        w.process.join(1.0)
        w.outbox.close()
        w.conn.close()
