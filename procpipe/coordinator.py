"""The coordinator: a background thread in the consumer's process that drives the workers.

It owns the slot free list, the task table (which batch is on which worker since when),
worker health and the epoch in progress. Its loop is::

    apply commands from the consumer (start epoch, cancel, close)
    dispatch tasks: one per free slot, at most two per worker (one running, one queued)
    wait (epoll) for: a reply on a worker's pipe, a worker's death, a wake-up byte
    turn replies into batches (views of their slot), pass them through reassembly
    into the epoch's queue, which the consumer reads

It sleeps in ``select`` whenever there is nothing to do, so it does not compete with the
training loop for the GIL.
"""
from __future__ import annotations

import os
import queue
import selectors
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import dill
import psutil

from . import collate, wire
from .errors import RemoteTraceback, WorkerError
from .reassembly import Ordered, Sloppy
from .shm import Ring, SharedFiles, round_slot_bytes
from .stats import EpochCounters, WorkerCounters
from .worker import worker_main

TASKS_PER_WORKER = 2  # one running, one queued so the worker never waits for the next
_HEALTH_INTERVAL_S = 0.5  # how often worker memory is sampled


class EndOfEpoch:
    """Queue marker: every batch of the epoch has been delivered."""


@dataclass
class Failure:
    """Queue item: the epoch ends with this exception, raised in the consumer."""

    exc: BaseException


@dataclass
class Task:
    gen: int  # the Epoch.gen this task belongs to
    seq: int  # position of the batch in the epoch
    indices: list[int]
    slot: int = -1  # -1: no slot, arrays come back inline
    worker: Any = None
    started: float = 0.0


@dataclass
class Epoch:
    """One pass over the data: what is left to do, and the consumer's queue."""

    gen: int  # unique id of this iteration, distinct from the epoch number
    number: int
    batches: list[list[int]]
    ordered: bool
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    counters: EpochCounters = None  # type: ignore[assignment]
    next_seq: int = 0  # next batch never dispatched yet
    redo: deque = field(default_factory=deque)  # tasks to dispatch again (their worker died)
    issued: int = 0  # distinct batches dispatched
    consumed: int = 0  # batches the consumer took (written by the consumer thread)
    delivered: int = 0
    finished: bool = False

    def __post_init__(self) -> None:
        self.reassembly = Ordered() if self.ordered else Sloppy()
        self.counters = EpochCounters(epoch=self.number)

    @property
    def has_work(self) -> bool:
        return not self.finished and (bool(self.redo) or self.next_seq < len(self.batches))

    def deliver(self, seq: int, item: Any) -> None:
        for ready in self.reassembly.add(seq, item):
            if self.finished:
                return
            self.out.put(ready)
            if isinstance(ready, Failure):
                self.finish()
                return
            self.delivered += 1
            if self.delivered == len(self.batches):
                self.finish()
                self.out.put(EndOfEpoch)

    def finish(self) -> None:
        self.finished = True
        self.redo.clear()
        if self.counters.ended is None:
            self.counters.ended = time.perf_counter()


@dataclass
class WorkerHandle:
    index: int
    process: Any
    conn: Any
    counters: WorkerCounters
    tasks: dict[int, Task] = field(default_factory=dict)
    fatal: str | None = None


@dataclass
class EngineConfig:
    """What the coordinator needs from the Loader's arguments."""

    workers: int
    ordered: bool
    prefetch: int
    slot_bytes: int | None
    max_worker_restarts: int
    worker_env: dict[str, str]
    start_method: str


class Coordinator:
    """Starts the workers and runs the dispatch/reply loop in a daemon thread."""

    def __init__(self, config: EngineConfig, ctx: Any, spec: Any, files: SharedFiles) -> None:
        self.config = config
        self._ctx = ctx
        self._spec = spec  # a WorkerSpec (fork) or the path of its pickle (other starts)
        self.files = files
        self.max_outstanding = config.prefetch + TASKS_PER_WORKER * config.workers
        self.ring: Ring | None = None
        if config.slot_bytes is not None:
            self._make_ring(config.slot_bytes)
        self.epoch: Epoch | None = None
        self.workers: list[WorkerHandle] = []
        self.worker_counters: list[WorkerCounters] = []
        self._tasks: dict[int, Task] = {}
        self._next_task_id = 0
        self._restarts_this_epoch = 0
        self._broken: BaseException | None = None
        self._overflow_warned = False
        self._commands: deque = deque()
        self._closing = False
        self._shut_down = False
        self.starved = False  # read by the consumer: wake me when capacity frees up
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        me = psutil.Process()
        self._parent = (me.pid, me.create_time())
        for i in range(config.workers):
            self.worker_counters.append(WorkerCounters())
            self.workers.append(self._start_worker(i))
        self._last_health = 0.0
        self._thread = threading.Thread(target=self._run, name="procpipe-coordinator", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- consumer side
    def submit(self, *command: Any) -> None:
        """Queue a command for the coordinator thread and wake it."""
        self._commands.append(command)
        self.wake()

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake (pipe full) or closing

    def consumed_one(self, epoch: Epoch) -> None:
        epoch.consumed += 1
        if self.starved:
            self.starved = False
            self.wake()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, end every worker, remove every shared file. Idempotent.

        The coordinator thread does the shutdown itself as it leaves its loop; if it is
        already gone (or this is that thread, e.g. a garbage collection running there),
        whatever is left is done here.
        """
        self.submit("close")
        if threading.current_thread() is self._thread:
            return
        self._thread.join(timeout)
        self._shutdown_workers()

    # ---------------------------------------------------------------- workers
    def _start_worker(self, index: int) -> WorkerHandle:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main,
            args=(index, child_conn, self._spec, self.files.prefix, *self._parent, self.config.worker_env),
            name=f"procpipe-worker-{index}",
            daemon=True,
        )
        process.start()
        child_conn.close()
        handle = WorkerHandle(index, process, parent_conn, self.worker_counters[index])
        self._selector.register(parent_conn.fileno(), selectors.EVENT_READ, (self._on_readable, handle))
        self._selector.register(process.sentinel, selectors.EVENT_READ, (self._on_exit, handle))
        return handle

    def _shutdown_workers(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                wire.send(w.conn, None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for w in workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in workers:
            if w.process.is_alive():
                _kill_tree(w.process.pid)
            w.process.join(1.0)
            w.conn.close()
        self.files.remove_all()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._selector.close()

    # ---------------------------------------------------------------- the loop
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug here must reach the consumer, not hang it
            self._broken = exc
            self._fail(exc)
        finally:
            if self._closing:
                self._shutdown_workers()

    def _loop(self) -> None:
        while True:
            while self._commands:
                self._apply(*self._commands.popleft())
            if self._closing:
                return
            self._dispatch()
            for key, _ in self._selector.select(_HEALTH_INTERVAL_S):
                if key.data is None:
                    _drain(self._wake_r)
                else:
                    callback, handle = key.data
                    callback(handle)
            now = time.monotonic()
            if now - self._last_health >= _HEALTH_INTERVAL_S:
                self._last_health = now
                self._sample_health()

    def _apply(self, command: str, *args: Any) -> None:
        if command == "start":
            if self.epoch is not None:
                self.epoch.finish()
            self.epoch = args[0]
            self._restarts_this_epoch = 0
            if self._broken is not None:
                self._fail(self._broken)
        elif command == "cancel":
            if self.epoch is not None and self.epoch.gen == args[0]:
                self.epoch.finish()
        elif command == "close":
            self._closing = True
            if self.epoch is not None:
                self.epoch.finish()

    def _dispatch(self) -> None:
        epoch = self.epoch
        if epoch is None or not epoch.has_work:
            self.starved = False
            return
        self.starved = True  # published before looking, so a release after the look wakes us
        while epoch.has_work:
            worker = min(self.workers, key=lambda w: len(w.tasks), default=None)
            if worker is None or len(worker.tasks) >= TASKS_PER_WORKER or worker.fatal:
                return
            if epoch.redo:
                task = epoch.redo.popleft()
                epoch.counters.redispatched_tasks += 1
            else:
                outstanding = epoch.issued - epoch.consumed
                if outstanding >= self.max_outstanding:
                    return
                if self.ring is not None and self.ring.free:
                    slot = self.ring.free.popleft()
                elif outstanding < len(self.workers):
                    # No free slot: before the ring exists (the first batches size it), or
                    # when the consumer holds every slot (e.g. list(loader)). Inline keeps
                    # the pipeline moving instead of deadlocking.
                    slot = -1
                else:
                    return
                task = Task(epoch.gen, epoch.next_seq, epoch.batches[epoch.next_seq], slot)
                epoch.next_seq += 1
                epoch.issued += 1
            self._send(worker, task)
        self.starved = False

    def _send(self, worker: WorkerHandle, task: Task) -> None:
        task_id = self._next_task_id
        self._next_task_id += 1
        task.worker = worker
        task.started = time.perf_counter()
        self._tasks[task_id] = task
        worker.tasks[task_id] = task
        ring = self.ring
        slot_bytes = ring.slot_bytes if ring is not None and task.slot >= 0 else 0
        ring_id = ring.ring_id if ring is not None else -1
        try:
            wire.send(worker.conn, (task_id, self.epoch.number, task.indices, ring_id, task.slot, slot_bytes))
        except OSError:
            pass  # the worker is dying; its sentinel fires and the task is redone

    # ---------------------------------------------------------------- replies
    def _on_readable(self, worker: WorkerHandle) -> None:
        try:
            while worker.conn.poll():
                self._on_message(worker, wire.recv(worker.conn))
        except (EOFError, OSError):
            self._selector.unregister(worker.conn.fileno())  # death is handled by the sentinel

    def _on_message(self, worker: WorkerHandle, message: tuple) -> None:
        kind = message[0]
        if kind == "fatal":
            worker.fatal = message[1]
            return
        task_id = message[1]
        task = self._tasks.pop(task_id, None)
        worker.tasks.pop(task_id, None)
        busy = message[-1]
        worker.counters.tasks += 1
        worker.counters.busy_s += busy
        epoch = self.epoch
        if task is None or epoch is None or epoch.finished or task.gen != epoch.gen:
            self._release_unused(task)
            return
        if kind == "ok":
            _, _, layout, nbytes, in_slot, _ = message
            if self.ring is None:
                self._make_ring_or_fail(nbytes)
            counters = epoch.counters
            if in_slot:
                batch = collate.build(layout, self.ring.lease(task.slot, self._release))
                counters.bytes_in_slots += nbytes
            else:
                self._release_unused(task)
                batch = collate.build(layout, None)
                counters.bytes_inline += nbytes
                if task.slot >= 0:
                    counters.overflow_batches += 1
                    self._warn_overflow(nbytes)
            counters.batches += 1
            counters.samples += len(task.indices)
            epoch.deliver(task.seq, batch)
        else:
            self._release_unused(task)
            epoch.deliver(task.seq, Failure(_rebuild_error(message, worker, task, epoch.number)))

    def _release_unused(self, task: Task | None) -> None:
        if task is not None and task.slot >= 0:
            self._release(task.slot)

    def _release(self, slot: int) -> None:
        """Return a slot to the ring (runs in whichever thread drops a batch's last view)."""
        ring = self.ring
        if ring is not None:
            ring.free.append(slot)
            if self.starved:
                self.starved = False
                self.wake()

    def _make_ring(self, slot_bytes: int) -> None:
        slots = self.max_outstanding + 1  # + the batch the consumer is working on
        self.ring = Ring(self.files, 0, slots, round_slot_bytes(slot_bytes))

    def _make_ring_or_fail(self, nbytes: int) -> None:
        try:
            self._make_ring(nbytes)
        except BaseException as exc:
            self._broken = exc
            raise

    def _warn_overflow(self, nbytes: int) -> None:
        if not self._overflow_warned:
            import warnings

            self._overflow_warned = True
            warnings.warn(
                f"procpipe: a batch of {nbytes} bytes did not fit the ring's {self.ring.slot_bytes}-byte "
                "slots (sized from the first batch) and took the slower inline path. If batch sizes vary, "
                "pass slot_bytes=<largest batch> to Loader.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _fail(self, exc: BaseException) -> None:
        epoch = self.epoch
        if epoch is not None and not epoch.finished:
            epoch.out.put(Failure(exc))
            epoch.finish()

    # ---------------------------------------------------------------- health
    def _on_exit(self, worker: WorkerHandle) -> None:
        self._selector.unregister(worker.process.sentinel)
        try:
            self._selector.unregister(worker.conn.fileno())
        except (KeyError, ValueError):
            pass
        self._on_readable_quietly(worker)
        worker.process.join(0.1)
        worker.conn.close()
        lost = sorted(worker.tasks.values(), key=lambda t: t.seq)
        for task_id in list(worker.tasks):
            self._tasks.pop(task_id, None)
        worker.tasks.clear()
        if self._closing:
            return
        epoch = self.epoch
        if epoch is not None:
            epoch.counters.worker_deaths += 1
            if not epoch.finished:
                epoch.redo.extendleft(reversed(lost))
        if worker.fatal is not None:
            exc = WorkerError(
                f"procpipe worker {worker.index} could not start: loading the dataset, fn or collate_fn "
                f"failed in the worker process.\n{worker.fatal}"
            )
            self._broken = exc
            self._fail(exc)
            return
        if self._restarts_this_epoch >= self.config.max_worker_restarts:
            self._fail(WorkerError(_death_message(worker, lost, self.config.max_worker_restarts)))
            return
        self._restarts_this_epoch += 1
        worker.counters.restarts += 1
        self.workers[self.workers.index(worker)] = self._start_worker(worker.index)

    def _on_readable_quietly(self, worker: WorkerHandle) -> None:
        """Read replies a worker sent before it died, so finished work is not redone."""
        try:
            while worker.conn.poll():
                self._on_message(worker, wire.recv(worker.conn))
        except (EOFError, OSError):
            pass

    def _sample_health(self) -> None:
        for w in self.workers:
            try:
                rss = psutil.Process(w.process.pid).memory_info().rss
            except (psutil.Error, TypeError):
                continue
            w.counters.rss_bytes = rss
            w.counters.peak_rss_bytes = max(w.counters.peak_rss_bytes, rss)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _kill_tree(pid: int) -> None:
    """SIGKILL a worker and anything it started."""
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
    psutil.wait_procs(procs, timeout=1.0)


def _rebuild_error(message: tuple, worker: WorkerHandle, task: Task, epoch: int) -> BaseException:
    """The worker's exception, with its original type when it unpickles, plus where it happened."""
    _, _, index, exc_bytes, type_name, text, tb, _ = message
    exc: BaseException | None = None
    if exc_bytes is not None:
        try:
            exc = dill.loads(exc_bytes)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = WorkerError(f"{type_name}: {text}")
    where = (f"while loading index {index}" if index is not None
             else f"while collating indices {task.indices}")
    exc.add_note(f"procpipe: raised in worker {worker.index} {where} (epoch {epoch}, batch {task.seq}); "
                 "the worker's traceback is shown above.")
    exc.__cause__ = RemoteTraceback(tb)
    return exc


def _death_message(worker: WorkerHandle, lost: list[Task], budget: int) -> str:
    code = worker.process.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    indices = [i for t in lost for i in t.indices]
    rss = worker.counters.rss_bytes
    if code == -signal.SIGKILL:
        cause = (f"SIGKILL usually means the out-of-memory killer (the worker's last RSS was "
                 f"{rss / 2**20:.0f} MiB; system memory available: {psutil.virtual_memory().available / 2**20:.0f} MiB). "
                 "Use fewer workers or less memory per sample")
    elif code == -signal.SIGSEGV or code == -signal.SIGBUS:
        cause = "a crash in native code (a C extension used by the dataset or fn)"
    else:
        cause = "user code ended the process (os._exit, sys.exit, or a library calling exit)"
    return (f"procpipe worker {worker.index} (pid {worker.process.pid}) {how} while holding indices {indices}; "
            f"workers have already been restarted {budget} times this epoch (max_worker_restarts={budget}). "
            f"Likely cause: {cause}.")
