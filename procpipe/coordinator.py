"""The coordinator: a background thread in the consumer's process that drives the workers.

It owns the slot free list, the task table (which batch is on which worker since when),
worker health and the epoch in progress. Its loop is::

    apply commands from the consumer (start epoch, cancel, close)
    watch for stragglers (speculate=...) and stuck workers (task_timeout=...)
    dispatch tasks: one per free slot, at most two per worker (one running, one queued)
    wait (epoll) for: a reply on a worker's pipe, a worker's death, a wake-up byte
    turn replies into batches (views of their slot), pass them through reassembly
    into the epoch's queue, which the consumer reads

It sleeps in ``select`` whenever there is nothing to do, so it does not compete with the
training loop for the GIL.

Fault tolerance. A batch of the epoch is a ``Job``; each time it is sent to a worker is
an ``Attempt``, with its own ring slot. A job normally has one attempt; it gets another
when its worker dies (the job is re-run from the start: samples are deterministic from
``(seed, epoch, index)``, so the result is the same), when it straggles (``speculate``:
a copy runs on a healthy worker), or when its worker is killed after ``task_timeout``.
The first attempt to finish delivers the batch; any other is discarded when it replies
(or dies), and its slot returns to the ring. Reassembly refuses a position twice, so no
batch is ever delivered twice.

Streams. One ``iter(loader)`` is a ``Stream``: one epoch (the default), N epochs or
endless (``Loader(epochs=...)``). The stream opens the next ``Epoch`` as soon as every
batch of the open ones has been dispatched, so workers keep working across the epoch
boundary; each epoch keeps its own reassembly, counters and progress, and all of them
feed one queue, tagged with their epoch.

Autotune. With ``workers="auto"`` a ``Tuner`` (autotune.py) is consulted every control
interval; the coordinator starts workers (``_add_worker``) or retires them (no more
tasks, then ``None`` once idle; ``_retire_worker``). The ring and the status words are
sized for the most workers the tuner may use.
"""
from __future__ import annotations

import logging
import math
import os
import queue
import selectors
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dill
import psutil

from . import collate, wire
from .autotune import Sample, Tuner, memory_room
from .errors import RemoteTraceback, TaskTimeoutError, WorkerError
from .reassembly import Ordered, Progress, Sloppy
from .shm import Ring, SharedFiles, create_file, map_file, round_slot_bytes
from .stats import EpochCounters, WorkerCounters, array_bytes, worker_baseline
from .worker import worker_main

# Tasks a worker holds at once: one running, the others queued so it never waits for the
# next. Small batches are dominated by the round trip, so they get a deeper queue; large
# ones would only cost ring memory.
TASKS_PER_WORKER = 2
TASKS_PER_WORKER_SMALL = 4
SMALL_BATCH_BYTES = 1 << 20
_HEALTH_INTERVAL_S = 0.5  # how often worker memory is sampled
TIMEOUT_ATTEMPTS = 2  # attempts a batch may have at once, or time out on before the epoch fails
_SPECULATE_MIN_S = 0.02  # never call a batch a straggler before it has run this long
_SPECULATE_AFTER = 5  # batches that must have finished before their median is trusted
_DURATIONS_KEPT = 64  # the running median covers this many recent batches

logger = logging.getLogger("procpipe")


def iteration_over(cancelled: str | None) -> None:
    """What ``next()`` does on an epoch iterator that has ended: say why if it was ended early."""
    if cancelled:
        raise RuntimeError(f"this epoch's iterator was ended early: {cancelled}")
    raise StopIteration


class EndOfEpoch:
    """Queue marker: the iteration is over: every batch of every epoch of the stream has been delivered."""


@dataclass(eq=False)
class EpochEnd:
    """Queue marker: every batch of ``epoch`` is in the queue, before this marker."""

    epoch: Epoch


class _Empty:
    """Reassembly item: a batch every sample of which was skipped (``on_error="skip"``)."""


@dataclass
class Failure:
    """Queue item: the epoch ends with this exception, raised in the consumer."""

    exc: BaseException


@dataclass(eq=False)
class Job:
    """One batch of an epoch, and the attempts now running it."""

    epoch: Epoch  # the epoch this job belongs to
    seq: int  # position of the batch in the epoch
    indices: list[int]
    attempts: list[Attempt] = field(default_factory=list)  # live ones (sent, no reply yet)
    done: bool = False  # an attempt replied; later replies are discarded
    timeouts: int = 0  # attempts killed after task_timeout
    slot: int = -1  # while waiting to be re-run: the slot of its last attempt (whose worker died)

    @property
    def gen(self) -> int:
        return self.epoch.gen


@dataclass(eq=False)
class Attempt:
    """One run of a job on one worker, into its own slot (-1: arrays come back inline)."""

    id: int
    job: Job
    worker: WorkerHandle
    slot: int
    started: float | None  # when the worker began it; None while queued behind another task
    skipped: list | None = None  # samples the worker left out (on_error="skip")


class SkipBudget:
    """``on_error="skip"`` for one epoch: logs each skip, records it, enforces ``max_skipped``.

    ``max_skipped`` is a count (int) or a fraction of the epoch's samples (float, rounded up).
    """

    def __init__(self, max_skipped: int | float, batches: list[list[int]], counters: EpochCounters) -> None:
        if isinstance(max_skipped, float):
            max_skipped = math.ceil(max_skipped * sum(map(len, batches)))
        self.limit = max_skipped
        self.given = max_skipped
        self.counters = counters

    def add(self, indices: list[int], what: str, error: str) -> bool:
        """Record ``indices`` as skipped; False once the epoch has skipped more than allowed."""
        self.counters.skipped.extend(indices)
        logger.warning("procpipe skipped %s (epoch %d): %s", what, self.counters.epoch, error)
        return len(self.counters.skipped) <= self.limit

    def note(self) -> str:
        return (f"procpipe: on_error='skip' has left out {len(self.counters.skipped)} samples of epoch "
                f"{self.counters.epoch} (indices {self.counters.skipped}), more than max_skipped allows "
                f"({self.limit}); this error is raised instead of being skipped.")


@dataclass(eq=False)
class Epoch:
    """One pass over the data within a ``Stream``: what is left to do, and what was delivered.

    ``done``: positions delivered before a resume (``Loader.load_state_dict``); they are
    neither loaded nor delivered again.
    """

    gen: int  # the stream's id (unique per iteration), distinct from the epoch number
    number: int
    batches: list[list[int]]
    ordered: bool
    done: frozenset = frozenset()
    stream: Stream | None = None
    counters: EpochCounters = None  # type: ignore[assignment]
    next_seq: int = 0  # next batch never dispatched yet
    redo: deque = field(default_factory=deque)  # jobs to dispatch again (their worker died)
    issued: int = 0  # distinct batches dispatched
    consumed: int = 0  # batches the consumer took (written by the consumer thread)
    dropped: int = 0  # batches that came out empty: every sample skipped (coordinator thread)
    delivered: int = 0
    finished: bool = False
    skips: SkipBudget | None = None  # set by the coordinator with on_error="skip"
    on_drop: Callable[[int], None] | None = None  # returns the slot of a job that will not run
    skipped_seqs: list = field(default_factory=list)  # positions that came out empty
    held: list = field(default_factory=list)  # queue items waiting for earlier epochs (ordered streams)

    def __post_init__(self) -> None:
        if self.done:
            self.done = frozenset(s for s in self.done if 0 <= s < len(self.batches))
        self.reassembly = (Ordered if self.ordered else Sloppy)(self.done)
        self.counters = EpochCounters(epoch=self.number)
        self.progress = Progress(self.done)  # what the consumer has had (consumer thread)
        self.remaining = len(self.batches) - len(self.done)
        self._skip_done()

    def _skip_done(self) -> None:
        while self.next_seq in self.done:
            self.next_seq += 1

    @property
    def has_work(self) -> bool:
        return not self.finished and (bool(self.redo) or self.next_seq < len(self.batches))

    @property
    def fresh(self) -> bool:
        """Batches never dispatched remain."""
        return not self.finished and self.next_seq < len(self.batches)

    def new_job(self) -> Job:
        seq = self.next_seq
        self.next_seq += 1
        self._skip_done()
        self.issued += 1
        self.stream.issued += 1
        return Job(self, seq, self.batches[seq])

    pins_workers = False  # True: ``dispatch(coordinator)`` sends its own jobs (procpipe.streaming)

    def ring_slot_bytes(self, layout: list, nbytes: int) -> int | None:
        """Slot size for the ring, from the first batch's layout and size (None: this one cannot tell)."""
        return nbytes

    def accept(self, job: Job, layout: list, lease: Any, skipped: int) -> None:
        """A job's batch arrived (``lease``: its ring slot, None if inline): count and deliver it."""
        self.counters.batches += 1
        self.counters.samples += len(job.indices) - skipped
        self.deliver(job.seq, collate.build(layout, lease))

    def drop(self) -> None:
        """A batch came out empty (every sample skipped): it will not reach the consumer."""
        self.dropped += 1
        self.stream.dropped += 1

    def deliver(self, seq: int, item: Any) -> None:
        for ready_seq, ready in self.reassembly.add(seq, item):
            if self.finished:
                return
            if isinstance(ready, Failure):
                self.stream.fail_at(self, ready)
                return
            if ready is _Empty:
                self.skipped_seqs.append(ready_seq)
            else:
                self.stream.emit(self, (self, ready_seq, ready))
            self.delivered += 1
            if self.delivered == self.remaining:
                self.stream.epoch_done(self)

    def done_seqs(self) -> Progress:
        """Positions the consumer has had, plus those that came out empty (consumer thread)."""
        done = Progress(self.progress)
        for seq in list(self.skipped_seqs):
            done.add(seq)
        return done

    # ---- the consumer's side (consumer thread): what it has had, for Loader.state_dict()
    def mark_consumed(self, seq: int) -> None:
        """The consumer took the batch at position ``seq``."""
        self.consumed += 1
        self.progress.add(seq)

    def consumer_progress(self) -> Progress:
        """What the consumer has had of this epoch, in the form a resume takes back (``done``)."""
        return self.done_seqs()

    def all_consumed(self) -> bool:
        """The consumer has had every batch of this epoch."""
        return len(self.done_seqs()) >= len(self.batches)

    @classmethod
    def unopened_progress(cls, resumed: Any) -> Progress:
        """``consumer_progress()`` of an epoch not opened yet: what a resume said of it (``ahead``), if anything."""
        return Progress(resumed or ())

    def finish(self) -> None:
        self.finished = True
        waiting = getattr(self.reassembly, "_waiting", None)
        if waiting:  # batches that will never be delivered (cancelled, or behind a failure)
            waiting.clear()
        redo, self.redo = self.redo, deque()
        for job in redo:
            if job.slot >= 0 and self.on_drop is not None:
                self.on_drop(job.slot)
        if self.counters.ended is None:
            self.counters.ended = time.perf_counter()


class Stream:
    """What one ``iter(loader)`` asked for: epochs ``start, start + 1, ...`` before ``until``
    (``None``: forever), as one continuous series of jobs.

    The coordinator opens the next epoch as soon as every batch of the open ones has been
    dispatched (``fresh``), so workers go on across the boundary instead of draining.
    Every epoch keeps its own reassembly, counters and progress; their batches go into
    one queue, ``out``, as ``(epoch, position, batch)`` tuples, each epoch followed by an
    ``EpochEnd`` marker and the stream by ``EndOfEpoch``. An ordered stream holds a later
    epoch's items back until every earlier epoch is out (order by epoch, then position);
    a sloppy one does not. A ``Failure`` ends the stream (in order, when ordered).

    Threads: the consumer creates the stream and its first epoch (so that ``batches()``
    errors surface in ``iter()``), reads ``out`` and writes ``consumed`` and ``wait_s``;
    the rest is the coordinator thread's. ``opened`` maps an epoch number to its ``Epoch``
    for the consumer (``Loader.state_dict``), which removes the epochs it is past.
    """

    def __init__(self, gen: int, sampler: Any, start: int, until: int | None, ordered: bool,
                 first_batches: list[list[int]], done: frozenset = frozenset(),
                 ahead: dict[int, frozenset] | None = None) -> None:
        self.gen = gen
        self.sampler = sampler
        self.start = start
        self.until = until
        self.ordered = ordered
        self.ahead = dict(ahead or {})  # epoch -> positions already delivered (resume); popped when opened
        self.resumed_ahead = dict(self.ahead)  # the same, kept (resume_point)
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.epochs: deque[Epoch] = deque()  # open: not yet finished, or (ordered) not yet all out
        self.opened: dict[int, Epoch] = {}
        self.next_number = start + 1  # the next epoch to open
        self.finished = False
        self.issued = 0  # batches dispatched, all epochs (coordinator thread)
        self.dropped = 0  # batches that came out empty (coordinator thread)
        self.consumed = 0  # batches the consumer took (consumer thread)
        self.wait_s = 0.0  # seconds the consumer waited in next() (consumer thread; autotune reads it)
        self.on_open: Callable[[Epoch], None] | None = None  # the coordinator's per-epoch set-up
        self.last: Epoch | None = None  # the epoch opened last
        # A streaming source's plan (procpipe.streaming) names its own Epoch class.
        self.epoch_class = getattr(sampler, "epoch_class", Epoch)
        self.first = self.epoch_class(gen, start, first_batches, ordered, done, stream=self)
        self.opened[start] = self.first

    @property
    def exhausted(self) -> bool:
        """No epoch is left to open."""
        return self.until is not None and self.next_number >= self.until

    def open(self, epoch: Epoch) -> None:
        self.last = epoch
        self.epochs.append(epoch)
        self.opened[epoch.number] = epoch
        if self.on_open is not None:
            self.on_open(epoch)
        if not epoch.remaining:  # empty, or resumed at its end
            self.epoch_done(epoch)

    def has_work(self) -> bool:
        if self.finished:
            return False
        return any(e.redo for e in self.epochs) or self.fresh() is not None

    def redo_job(self) -> Job | None:
        for epoch in self.epochs:
            if epoch.redo and not epoch.finished:
                return epoch.redo.popleft()
        return None

    def fresh(self) -> Epoch | None:
        """The first open epoch with batches never dispatched, opening the next epochs as needed."""
        for epoch in self.epochs:
            if epoch.fresh:
                return epoch
        while not self.finished and not self.exhausted:
            number = self.next_number
            self.next_number += 1
            try:
                batches = self.sampler.batches(number)
            except Exception as exc:
                exc.add_note(f"procpipe: raised while computing the batches of epoch {number}")
                failed = Epoch(self.gen, number, [], self.ordered, stream=self)
                self.epochs.append(failed)
                self.fail_at(failed, Failure(exc))
                return None
            if not batches and self.until is None:
                self.until = number  # an empty epoch would repeat forever: the stream ends here
                self._maybe_end()
                return None
            epoch = self.epoch_class(self.gen, number, batches, self.ordered, self.ahead.pop(number, frozenset()),
                                     stream=self)
            self.open(epoch)
            if epoch.fresh:
                return epoch
        return None

    def resume_point(self, low: int) -> tuple[int, Any, dict[int, Any], int | None] | None:
        """Where the consumer stands (consumer thread), to resume exactly there: ``(epoch, what it
        has had of it, {later epoch: what it has had of it}, until)``, each in the form of
        ``Epoch.consumer_progress()``; None once it has had everything. ``low``: the oldest
        epoch it is not past."""
        opened = dict(self.opened)  # a copy: the coordinator thread adds epochs

        def progress(n: int) -> tuple[Any, bool]:
            epoch = opened.get(n)
            if epoch is not None:
                return epoch.consumer_progress(), epoch.all_consumed()
            return self.epoch_class.unopened_progress(self.resumed_ahead.get(n)), False

        until = self.until
        done, complete = progress(low)
        if complete:  # all returned; its end marker not read yet
            low += 1
            if until is not None and low >= until:
                return None
            done, _ = progress(low)
        ahead = {}
        for n in sorted(set(opened) | set(self.resumed_ahead)):
            if n > low:
                p, _ = progress(n)
                if p:
                    ahead[n] = p
        return low, done, ahead, until

    def current_counters(self) -> EpochCounters | None:
        """Counters of the oldest open epoch, else the last opened (where a worker death is counted)."""
        if self.epochs:
            return self.epochs[0].counters
        return self.last.counters if self.last is not None else None

    # ---- output (coordinator thread)
    def emit(self, epoch: Epoch, item: Any) -> None:
        if self.ordered and self.epochs and epoch is not self.epochs[0]:
            epoch.held.append(item)  # an earlier epoch is not all out yet
        else:
            self._put(item)

    def _put(self, item: Any) -> None:
        self.out.put(item)
        if isinstance(item, Failure):
            self.finish()

    def epoch_done(self, epoch: Epoch) -> None:
        """Every batch of ``epoch`` has been delivered (or it had none)."""
        epoch.finish()
        self.emit(epoch, EpochEnd(epoch))
        if not self.ordered:
            self.epochs.remove(epoch)
        else:
            while self.epochs and self.epochs[0].finished:
                self.epochs.popleft()
                if self.epochs:
                    head = self.epochs[0]
                    held, head.held = head.held, []
                    for item in held:
                        self._put(item)
                        if self.finished:
                            return
        self._maybe_end()

    def _maybe_end(self) -> None:
        if not self.finished and not self.epochs and self.exhausted:
            self.finished = True
            self.out.put(EndOfEpoch)

    def fail_at(self, epoch: Epoch, failure: Failure) -> None:
        """``epoch`` failed: raise in the consumer once the epochs before it are out (ordered)."""
        if not self.ordered or not self.epochs or epoch is self.epochs[0]:
            self._put(failure)
            return
        epoch.held.append(failure)
        epoch.finish()
        self.until = epoch.number + 1 if self.until is None else min(self.until, epoch.number + 1)
        for later in [e for e in self.epochs if e.number > epoch.number]:
            later.finish()
            self.epochs.remove(later)

    def fail(self, exc: BaseException) -> None:
        """End the stream now with ``exc`` (a worker error, a timeout, a broken engine)."""
        if not self.finished:
            self._put(Failure(exc))

    def finish(self) -> None:
        """Stop: the stream ended, failed or was cancelled; replies still coming are discarded."""
        self.finished = True
        for epoch in self.epochs:
            epoch.finish()
            epoch.held.clear()  # (epoch -> held -> item -> epoch: a cycle holding ring slots)
        self.epochs.clear()

    def abandon(self) -> None:
        """The consumer is gone (cancel, a new iteration, close): stop, and drop what is queued.

        Queued items reference their epoch, which references this stream, which holds the
        queue: a cycle that would keep those batches, and their ring slots, alive until the
        cyclic garbage collector runs. Dropping them returns the slots now. A reader still
        blocked on the queue (a device stage thread) gets ``EndOfEpoch``.
        """
        self.finish()
        while True:
            try:
                self.out.get_nowait()
            except queue.Empty:
                break
        self.out.put(EndOfEpoch)


@dataclass(eq=False)
class WorkerHandle:
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
    on_error: str = "raise"
    max_skipped: int | float = 0.01
    task_timeout: float | None = None
    speculate: float | None = None
    autotune: Any = None  # an AutoWorkers (workers="auto"); ``workers`` is then the count to start with


class Coordinator:
    """Starts the workers and runs the dispatch/reply loop in a daemon thread."""

    def __init__(self, config: EngineConfig, ctx: Any, spec: Any, files: SharedFiles) -> None:
        self.config = config
        self._ctx = ctx
        self._spec = spec  # a WorkerSpec (fork) or the path of its pickle (other starts)
        self.files = files
        self.tasks_per_worker = TASKS_PER_WORKER  # deepened once the first batch shows it is small
        self.n_workers = config.workers  # workers given tasks (autotune changes it; retiring ones excluded)
        # The most workers at once: status words and worker indices are sized for it.
        self.capacity = config.workers if config.autotune is None else max(config.autotune.hard_max, config.workers)
        self.max_outstanding = config.prefetch + TASKS_PER_WORKER * config.workers
        # Speculative attempts need slots of their own, beyond those of the batches in flight.
        self.spare_slots = config.workers if config.speculate is not None else 0
        self.tuner: Tuner | None = None
        if config.autotune is not None:
            self.tuner = Tuner(config.autotune, self.capacity, config.workers, time.monotonic())
        self._tune_base: tuple | None = None
        self._next_tune = 0.0
        self._cpu_seen: dict[int, tuple[float, float]] = {}
        self.ring: Ring | None = None
        if config.slot_bytes is not None:
            self._make_ring(config.slot_bytes)
        self.stream: Stream | None = None
        self.workers: list[WorkerHandle] = []
        self.worker_counters: list[WorkerCounters] = []
        self._attempts: dict[int, Attempt] = {}
        self._next_attempt_id = 0
        self._durations: deque[float] = deque(maxlen=_DURATIONS_KEPT)  # recent batches' busy time
        self._watching = config.speculate is not None or config.task_timeout is not None
        self._restarts_this_epoch = 0
        self._broken: BaseException | None = None
        self._overflow_warned = False
        self._commands: deque = deque()
        self._closing = False
        self._shut_down = False
        self.starved = False  # read by the consumer: wake me when capacity frees up
        status_path = files.path("status")
        create_file(status_path, 16 * self.capacity, "the workers' status words")
        self._status_map = map_file(status_path)
        self._status = memoryview(self._status_map).cast("q")  # (task id, index) per worker
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

    def consumed_one(self, stream: Stream, epoch: Epoch, seq: int) -> None:
        epoch.mark_consumed(seq)
        stream.consumed += 1
        if self.starved:
            self.starved = False
            self.wake()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def autotune_info(self) -> dict[str, Any] | None:
        """``stats()["autotune"]``: None unless ``workers="auto"``."""
        return None if self.tuner is None else self.tuner.info(self.n_workers)

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

    def _add_worker(self) -> bool:
        """Autotune: start one more worker, at the lowest free index; False if none is free."""
        used = {w.index for w in self.workers}
        index = next((i for i in range(self.capacity) if i not in used), None)
        if index is None:
            return False
        while len(self.worker_counters) <= index:
            self.worker_counters.append(WorkerCounters())
        self.workers.append(self._start_worker(index))
        self.n_workers += 1
        self._set_outstanding()
        return True

    def _retire_worker(self) -> bool:
        """Autotune: the live worker with the highest index gets no more tasks, and stops once idle."""
        live = [w for w in self.workers if not (w.retiring or w.dead)]
        if len(live) <= 1:
            return False
        worker = max(live, key=lambda w: w.index)
        worker.retiring = True
        self.n_workers -= 1
        self._set_outstanding()
        self._stop_if_idle(worker)
        return True

    def _stop_if_idle(self, worker: WorkerHandle) -> None:
        if worker.retiring and not worker.tasks and not worker.stop_sent:
            worker.stop_sent = True
            try:
                wire.send(worker.conn, None)  # it exits; its sentinel fires and _on_exit removes it
            except OSError:
                pass

    def _set_outstanding(self) -> None:
        self.max_outstanding = self.config.prefetch + self.tasks_per_worker * self.n_workers

    def _workers_cpu(self) -> tuple[float, float]:
        """Seconds the live workers' main threads spent on a CPU, and runnable waiting for one,
        since last asked (a new worker: since it started).

        From ``/proc/<pid>/schedstat`` (nanoseconds) where the kernel has it, else psutil's
        CPU times (10 ms ticks; no run-queue figure).
        """
        cpu = runq = 0.0
        seen: dict[int, tuple[float, float]] = {}
        for w in self.workers:
            pid = w.process.pid
            try:
                with open(f"/proc/{pid}/schedstat", "rb") as f:
                    fields = f.read().split()
                now = (int(fields[0]) / 1e9, int(fields[1]) / 1e9)
            except (OSError, ValueError, IndexError):
                try:
                    if w.ps is None:
                        w.ps = psutil.Process(pid)
                    t = w.ps.cpu_times()
                except (psutil.Error, TypeError, ValueError):
                    continue
                now = (t.user + t.system, 0.0)
            seen[pid] = now
            before = self._cpu_seen.get(pid, (0.0, 0.0))
            cpu += max(0.0, now[0] - before[0])
            runq += max(0.0, now[1] - before[1])
        self._cpu_seen = seen
        return cpu, runq

    def _tune(self, now: float) -> None:
        """Autotune: close a control interval (if long enough), ask the tuner, follow it."""
        tuner, auto = self.tuner, self.config.autotune
        stream = self.stream
        self._next_tune = now + auto.interval
        if stream is None or stream.finished or self.ring is None:
            self._tune_base = None  # between iterations (or before the first batch): nothing to measure
            return
        base = self._tune_base
        if base is None or base[1] is not stream:
            self._workers_cpu()
            self._tune_base = (now, stream, stream.consumed, stream.wait_s,
                               sum(c.busy_s for c in self.worker_counters), 0.0)
            return
        dt = now - base[0]
        consumed = stream.consumed - base[2]
        if consumed < auto.min_batches and dt < 8 * auto.interval:
            return  # too few batches to judge yet: extend the interval
        busy = sum(c.busy_s for c in self.worker_counters)
        cpu, runq = self._workers_cpu()
        wait = stream.wait_s
        self._tune_base = (now, stream, stream.consumed, wait, busy, 0.0)
        rss = max((w.counters.rss_bytes for w in self.workers), default=0)
        tuner.memory_room = memory_room(rss) if rss else None
        sample = Sample(dt, consumed / dt, min(1.0, max(0.0, (wait - base[3]) / dt)),
                        max(0.0, busy - base[4]) / dt, cpu / dt, runq / dt)
        target = tuner.step(now, sample)
        while self.n_workers < target and self._add_worker():
            pass
        while self.n_workers > target and self._retire_worker():
            pass
        tuner.workers = self.n_workers

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
        self._status.release()
        self._status_map.close()  # an mmap holds a file descriptor until closed
        if self.ring is not None:
            self.ring.close()
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:  # a late wake() (a batch dropped after close) now fails instead of writing to a reused fd
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
            wait = self._watch(time.perf_counter()) if self._watching else _HEALTH_INTERVAL_S
            if self.tuner is not None:
                now = time.monotonic()
                if now >= self._next_tune:
                    self._tune(now)
                wait = min(wait, max(0.001, self._next_tune - now))
            self._dispatch()
            for key, _ in self._selector.select(wait):
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
            if self.stream is not None:
                self.stream.abandon()
            stream = self.stream = args[0]
            stream.on_open = self._on_open
            stream.open(stream.first)
            for i, w in enumerate(self.workers):
                if w.dead:  # it died past the previous epoch's budget: a fresh start
                    self.workers[i] = self._start_worker(w.index)
            if self._broken is not None:
                self._fail(self._broken)
        elif command == "cancel":
            if self.stream is not None and self.stream.gen == args[0]:
                self.stream.abandon()
        elif command == "close":
            self._closing = True
            if self.stream is not None:
                self.stream.abandon()

    def _on_open(self, epoch: Epoch) -> None:
        """A stream opened ``epoch`` (coordinator thread): its per-epoch budgets and baselines."""
        epoch.on_drop = self._release
        if self.config.on_error == "skip":
            epoch.skips = SkipBudget(self.config.max_skipped, epoch.batches, epoch.counters)
        epoch.counters.worker_base = worker_baseline(self.worker_counters)
        self._restarts_this_epoch = 0

    def _idle_worker(self) -> WorkerHandle | None:
        """The healthy worker with the fewest tasks, if it can take one more."""
        best = None
        for w in self.workers:
            if (w.fatal or w.stalled or w.killed_for or w.dead or w.retiring
                    or len(w.tasks) >= self.tasks_per_worker):
                continue
            if best is None or len(w.tasks) < len(best.tasks):
                best = w
        return best

    def _take_slot(self, epoch: Epoch) -> int | None:
        ring = self.ring
        if ring is None or not ring.free:
            return None
        slot = ring.free.popleft()
        epoch.counters.peak_slots_in_use = max(epoch.counters.peak_slots_in_use, ring.slots - len(ring.free))
        return slot

    def _dispatch(self) -> None:
        stream = self.stream
        if stream is None or stream.finished:
            self.starved = False
            return
        self.starved = True  # published before looking, so a release after the look wakes us
        if self._watching:
            self._speculate()
        if stream.first.pins_workers:  # a streaming source: each block goes to its shard's worker
            stream.fresh()  # opens the next epoch once the open ones have nothing new to dispatch
            self.starved = any([epoch.dispatch(self) for epoch in list(stream.epochs)])
            return
        while stream.has_work():  # across epochs: the next epoch opens once this one is all dispatched
            worker = self._idle_worker()
            if worker is None:
                return
            job = stream.redo_job()
            if job is not None:
                slot, job.slot = job.slot, -1
                job.epoch.counters.redispatched_tasks += 1
            else:
                outstanding = stream.issued - stream.consumed - stream.dropped
                if outstanding >= self.max_outstanding:
                    return
                epoch = stream.fresh()
                slot = self._take_slot(epoch)
                if slot is None:
                    if outstanding >= self.n_workers:
                        return
                    # No free slot: before the ring exists (the first batches size it), or
                    # when the consumer holds every slot (e.g. list(loader)). Inline keeps
                    # the pipeline moving instead of deadlocking.
                    slot = -1
                job = epoch.new_job()
            self._send(worker, job, slot)
        self.starved = False

    def _send(self, worker: WorkerHandle, job: Job, slot: int) -> None:
        attempt = Attempt(self._next_attempt_id, job, worker, slot, None if worker.tasks else time.perf_counter())
        self._next_attempt_id += 1
        self._attempts[attempt.id] = attempt
        worker.tasks[attempt.id] = attempt
        job.attempts.append(attempt)
        ring = self.ring
        slot_bytes = ring.slot_bytes if ring is not None and slot >= 0 else 0
        ring_id = ring.ring_id if ring is not None else -1
        try:
            wire.send(worker.conn, (attempt.id, job.epoch.number, job.indices, ring_id, slot, slot_bytes))
        except OSError:
            pass  # the worker is dying; its sentinel fires and the task is redone

    # ---------------------------------------------------------------- stragglers
    def _watch(self, now: float) -> float:
        """Mark straggling workers, kill those stuck past task_timeout; seconds until the next look."""
        timeout = self.config.task_timeout
        threshold = None
        if self.config.speculate is not None and len(self._durations) >= _SPECULATE_AFTER:
            threshold = max(self.config.speculate * statistics.median(self._durations), _SPECULATE_MIN_S)
        wait = _HEALTH_INTERVAL_S
        for w in self.workers:
            if not w.tasks or w.killed_for or w.dead:
                continue
            head = next(iter(w.tasks.values()))
            if head.started is None:
                head.started = now
            running = now - head.started
            if timeout is not None:
                if running >= timeout:
                    w.killed_for = head
                    _kill_tree(w.process.pid, wait=False)  # its sentinel fires: _on_exit re-runs its tasks
                    continue
                wait = min(wait, timeout - running)
            if threshold is not None and not w.stalled:
                if running >= threshold:
                    w.stalled = True
                else:
                    wait = min(wait, threshold - running)
        return max(wait, 0.001)

    def _speculate(self) -> None:
        """Give the batches held by straggling workers to healthy ones too; the first result wins."""
        for w in self.workers:
            if not w.stalled:
                continue
            for attempt in list(w.tasks.values()):
                job = attempt.job
                epoch = job.epoch
                if (job.done or epoch.finished or any(_healthy(a.worker) for a in job.attempts)
                        or len(job.attempts) + job.timeouts >= TIMEOUT_ATTEMPTS):
                    continue  # done, healthy elsewhere, or already tried as often as a batch may be
                target = self._idle_worker()
                if target is None:
                    return
                slot = self._take_slot(epoch) if self.ring is not None else -1
                if slot is None:
                    return
                epoch.counters.speculative_tasks += 1
                self._send(target, job, slot)

    # ---------------------------------------------------------------- replies
    def _on_readable(self, worker: WorkerHandle) -> None:
        """The selector saw a reply: read it, and any others already waiting."""
        try:
            self._on_message(worker, wire.recv(worker.conn))
            self._read_waiting(worker)
        except (EOFError, OSError):
            self._selector.unregister(worker.conn.fileno())  # death is handled by the sentinel

    def _read_waiting(self, worker: WorkerHandle) -> None:
        while worker.conn.poll():
            self._on_message(worker, wire.recv(worker.conn))

    def _on_message(self, worker: WorkerHandle, message: tuple) -> None:
        kind = message[0]
        if kind == "fatal":
            worker.fatal = message[1]
            return
        if kind == "skip":
            attempt = self._attempts.get(message[1])
            if attempt is not None:
                attempt.skipped = message[2]
            return
        attempt = self._attempts.pop(message[1], None)
        worker.tasks.pop(message[1], None)
        if worker.retiring:
            self._stop_if_idle(worker)
        busy = message[-1]
        worker.counters.tasks += 1
        worker.counters.busy_s += busy
        if self._watching:
            self._durations.append(busy)
            worker.stalled = False
            if worker.tasks:  # the worker starts its queued task now
                next(iter(worker.tasks.values())).started = time.perf_counter()
        if attempt is None:
            return
        job = attempt.job
        job.attempts.remove(attempt)
        epoch = job.epoch
        if job.done or epoch.finished:
            self._release_unused(attempt.slot)  # a lost race, or a cancelled epoch
            return
        job.done = True
        if kind == "ok":
            _, _, layout, nbytes, in_slot, _ = message
            if attempt.skipped and not self._skip(epoch, job, worker, attempt.skipped, None):
                self._release_unused(attempt.slot)
                return
            if layout is None:  # every sample was skipped
                self._release_unused(attempt.slot)
                epoch.drop()
                epoch.deliver(job.seq, _Empty)
                return
            if self.ring is None:
                slot_bytes = epoch.ring_slot_bytes(layout, nbytes)
                if slot_bytes is not None:
                    self._make_ring_or_fail(slot_bytes)
            counters = epoch.counters
            if in_slot:
                lease = self.ring.lease(attempt.slot, self._release)
                counters.bytes_in_slots += nbytes
            else:
                self._release_unused(attempt.slot)
                lease = None
                counters.bytes_inline += nbytes
                if attempt.slot >= 0:
                    counters.overflow_batches += 1
                    self._warn_overflow(nbytes)
            counters.array_bytes += array_bytes(layout)
            epoch.accept(job, layout, lease, len(attempt.skipped or ()))
        else:
            self._release_unused(attempt.slot)
            error = message[2:7]
            if epoch.skips is None:
                epoch.deliver(job.seq, Failure(_rebuild_error(error, worker, job, epoch.number)))
            elif self._skip(epoch, job, worker, attempt.skipped or [], error):
                epoch.drop()
                epoch.deliver(job.seq, _Empty)

    def _skip(self, epoch: Epoch, job: Job, worker: WorkerHandle, samples: list[tuple], batch_error: tuple | None) -> bool:
        """on_error="skip": log and count what the batch left out; past the budget, fail the epoch.

        ``samples``: ``(index, ...)`` of each sample the worker left out; ``batch_error``: why
        the rest of the batch failed (collation), or None. Returns False if the epoch failed.
        """
        skips = epoch.skips
        within = True
        for info in samples:
            within = skips.add([info[0]], f"index {info[0]} (batch {job.seq}, worker {worker.index})",
                               f"{info[2]}: {info[3]}")
            logger.debug("procpipe: the worker's traceback for index %s:\n%s", info[0], info[4])
            if not within:
                error = info
                break
        if within and batch_error is not None:
            left = {info[0] for info in samples}
            rest = [i for i in job.indices if i not in left]
            where = "collating it" if batch_error[0] is None else f"loading index {batch_error[0]}"
            within = skips.add(rest, f"batch {job.seq} (indices {rest}, worker {worker.index})",
                               f"{where} failed: {batch_error[2]}: {batch_error[3]}")
            logger.debug("procpipe: the worker's traceback for batch %s:\n%s", job.seq, batch_error[4])
            error = batch_error
        if within:
            return True
        exc = _rebuild_error(error, worker, job, epoch.number)
        exc.add_note(skips.note())
        epoch.deliver(job.seq, Failure(exc))
        return False

    def _release_unused(self, slot: int) -> None:
        if slot >= 0:
            self._release(slot)

    def _release(self, slot: int) -> None:
        """Return a slot to the ring (runs in whichever thread drops a batch's last view)."""
        ring = self.ring
        if ring is not None:
            ring.free.append(slot)
            if self.starved:
                self.starved = False
                self.wake()

    def _make_ring(self, slot_bytes: int) -> None:
        if slot_bytes <= SMALL_BATCH_BYTES:
            self.tasks_per_worker = TASKS_PER_WORKER_SMALL
        self._set_outstanding()
        slot_bytes = round_slot_bytes(slot_bytes)
        workers = self._ring_workers(slot_bytes)
        if self.config.speculate is not None:
            self.spare_slots = workers
        # + the batch the consumer is working on
        slots = self.config.prefetch + self.tasks_per_worker * workers + 1 + self.spare_slots
        self.ring = Ring(self.files, 0, slots, slot_bytes)

    def _ring_workers(self, slot_bytes: int) -> int:
        """Workers the ring is sized for: all of them, or with autotune the most it may use.

        Autotune sizes the ring once, for its maximum (rings never grow), but keeps it
        within a quarter of the free space of ``shm_dir`` and of available memory; the
        tuner then never goes beyond what the ring serves.
        """
        if self.tuner is None:
            return self.config.workers
        per_worker = slot_bytes * (self.tasks_per_worker + (1 if self.config.speculate is not None else 0))
        try:
            budget = 0.25 * min(psutil.disk_usage(self.files.directory).free, psutil.virtual_memory().available)
        except OSError:
            budget = 0.0
        fit = int((budget - (self.config.prefetch + 1) * slot_bytes) // per_worker)
        workers = max(self.n_workers, min(self.capacity, fit))
        self.tuner.capacity = workers
        return workers

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
        stream = self.stream
        if stream is not None and not stream.finished:
            stream.fail(exc)

    # ---------------------------------------------------------------- health
    def _on_exit(self, worker: WorkerHandle) -> None:
        """A worker died (or was killed): re-run what it held, and replace it."""
        self._selector.unregister(worker.process.sentinel)
        try:
            self._selector.unregister(worker.conn.fileno())
        except (KeyError, ValueError):
            pass
        self._on_readable_quietly(worker)
        worker.process.join(0.1)
        worker.conn.close()
        lost = list(worker.tasks.values())
        for attempt in lost:
            self._attempts.pop(attempt.id, None)
        worker.tasks.clear()
        if self._closing:
            return
        if worker.retiring:  # autotune retired it: it leaves for good
            self._cpu_seen.pop(worker.process.pid, None)
            if worker in self.workers:
                self.workers.remove(worker)
            if not lost:
                return
        stuck_on = self._stuck_index(worker, worker.killed_for or (lost[0] if lost else None))
        stream = self.stream
        if stream is not None:
            counters = stream.current_counters()
            if counters is not None:
                counters.worker_deaths += 1
        redo, timed_out = [], None
        for attempt in lost:
            job = attempt.job
            job.attempts.remove(attempt)
            if job.done or job.epoch.finished:
                self._release_unused(attempt.slot)  # finished elsewhere, or a stale epoch's
                continue
            if attempt is worker.killed_for:
                job.timeouts += 1
                job.epoch.counters.timed_out_tasks += 1
            if job.attempts:
                self._release_unused(attempt.slot)  # still running elsewhere (speculation)
                continue
            if job.timeouts >= TIMEOUT_ATTEMPTS:
                timed_out = job
            job.slot = attempt.slot
            redo.append(job)
        for epoch in {job.epoch: None for job in redo}:
            epoch.redo.extendleft(sorted((j for j in redo if j.epoch is epoch), key=lambda j: j.seq, reverse=True))
        if timed_out is not None:
            self._fail(TaskTimeoutError(_timeout_message(timed_out, stuck_on, self.config.task_timeout,
                                                         timed_out.epoch.number), stuck_on))
        if worker.retiring:
            return
        if worker.fatal is not None:
            exc = WorkerError(
                f"procpipe worker {worker.index} could not start: loading the dataset, fn or collate_fn "
                f"failed in the worker process.\n{worker.fatal}"
            )
            self._broken = exc
            self._fail(exc)
            return
        if worker.killed_for is None:  # it died by itself: that counts against the budget
            if self._restarts_this_epoch >= self.config.max_worker_restarts:
                self._fail(WorkerError(_death_message(worker, lost, stuck_on, self.config.max_worker_restarts)))
                worker.dead = True  # no restart (a crash loop must not spin between epochs)
                return
            self._restarts_this_epoch += 1
        worker.counters.restarts += 1
        self.workers[self.workers.index(worker)] = self._start_worker(worker.index)

    def _stuck_index(self, worker: WorkerHandle, attempt: Attempt | None) -> int | None:
        """The index a dead worker was loading for ``attempt`` when it died, if known (-1: collating)."""
        if attempt is None:
            return None
        task_id, index = self._status[2 * worker.index], self._status[2 * worker.index + 1]
        return index if task_id == attempt.id else None

    def _on_readable_quietly(self, worker: WorkerHandle) -> None:
        """Read replies a worker sent before it died, so finished work is not redone."""
        try:
            self._read_waiting(worker)
        except (EOFError, OSError):
            pass

    def _sample_health(self) -> None:
        for w in self.workers:
            if w.dead:
                continue
            try:
                rss = psutil.Process(w.process.pid).memory_info().rss
            except (psutil.Error, TypeError):
                continue
            w.counters.rss_bytes = rss
            w.counters.peak_rss_bytes = max(w.counters.peak_rss_bytes, rss)


def _healthy(worker: WorkerHandle) -> bool:
    return not (worker.stalled or worker.killed_for or worker.dead)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _kill_tree(pid: int, wait: bool = True) -> None:
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


def _rebuild_error(error: tuple, worker: WorkerHandle, job: Job, epoch: int) -> BaseException:
    """The worker's exception, with its original type when it unpickles, plus where it happened.

    ``error``: ``(index, exc_bytes, type_name, message, traceback)`` as the worker sent it.
    """
    index, exc_bytes, type_name, text, tb = error
    exc: BaseException | None = None
    if exc_bytes is not None:
        try:
            exc = dill.loads(exc_bytes)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = WorkerError(f"{type_name}: {text}")
    where = (f"while loading index {index}" if index is not None
             else f"while collating indices {job.indices}")
    exc.add_note(f"procpipe: raised in worker {worker.index} {where} (epoch {epoch}, batch {job.seq}); "
                 "the worker's traceback is shown above.")
    exc.__cause__ = RemoteTraceback(tb)
    return exc


def _where(index: int | None) -> str:
    if index is None:
        return ""
    return " while collating its batch" if index < 0 else f" while loading index {index}"


def _timeout_message(job: Job, index: int | None, timeout: float | None, epoch: int) -> str:
    stuck = f"index {index}" if index is not None and index >= 0 else (
        "collating the batch" if index is not None else "an unknown sample")
    return (f"procpipe: batch {job.seq} of epoch {epoch} (indices {job.indices}) was still running after "
            f"task_timeout={timeout} s on each of its {job.timeouts} attempts; the worker was stuck on {stuck}. "
            "Each stuck worker was killed and replaced. Fix what blocks that sample (a hung read, a lock, "
            "an endless loop in fn), or raise task_timeout if it legitimately takes that long.")


def _death_message(worker: WorkerHandle, lost: list[Attempt], index: int | None, budget: int) -> str:
    code = worker.process.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    indices = [i for a in lost for i in a.job.indices]
    rss = worker.counters.rss_bytes
    if code == -signal.SIGKILL:
        cause = (f"SIGKILL usually means the out-of-memory killer (the worker's last RSS was "
                 f"{rss / 2**20:.0f} MiB; system memory available: {psutil.virtual_memory().available / 2**20:.0f} MiB). "
                 "Use fewer workers or less memory per sample")
    elif code == -signal.SIGSEGV or code == -signal.SIGBUS:
        cause = "a crash in native code (a C extension used by the dataset or fn)"
    else:
        cause = "user code ended the process (os._exit, sys.exit, or a library calling exit)"
    return (f"procpipe worker {worker.index} (pid {worker.process.pid}) {how}{_where(index)}, holding indices "
            f"{indices}; workers have already been restarted {budget} times this epoch "
            f"(max_worker_restarts={budget}). Likely cause: {cause}.")
