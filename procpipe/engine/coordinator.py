"""The coordinator: a background thread in the consumer's process that drives the workers.

The data path, top to bottom: the consumer's ``iter(loader)`` (loader.py; its epoch
iterator, iterators.py) hands a ``Stream`` of epochs and their batches (epochs.py) to
this thread, which sends each batch to a worker process (started by pool.py; worker/process.py
runs in it). The worker writes the collated batch into a ring slot (shm.py, collate.py) and
replies with its layout; here the reply becomes a batch of views of that slot, which the
epoch passes through reassembly (reassembly.py) into the stream's queue the consumer reads.

The coordinator owns the slot free list, the task table (which batch is on which worker
since when), worker health and the stream in progress. Its loop is::

    apply commands from the consumer (start a stream, cancel, close)
    watch for stragglers (speculate=...) and stuck workers (task_timeout=...)
    dispatch tasks: one per free slot, a few per worker (one running, the rest queued)
    wait (epoll) for: a reply on a worker's pipe, a worker's death, a wake-up byte
    turn replies into batches (views of their slot) and deliver them to their epoch

It sleeps in ``select`` whenever there is nothing to do, so it does not compete with the
training loop for the GIL.

Fault tolerance. A batch of the epoch is a ``Job``; each time it is sent to a worker is
an ``Attempt``, with its own ring slot. A job normally has one attempt; it gets another
when its worker dies (the job is re-run from the start: samples are deterministic from
``(seed, epoch, index)``, so the result is the same), when it straggles (``speculate``:
a copy runs on a healthy worker), or when its worker is killed after ``task_timeout``.
The first attempt to finish delivers the batch; any other is discarded when it replies
(or dies), and its slot returns to the ring. Reassembly refuses a position twice, so no
batch is ever delivered twice. What the consumer is told when a batch fails is built
in faults.py.

Autotune. With ``workers="auto"`` a ``Tuner`` (autotune.py) is consulted every control
interval; the coordinator starts workers (``_add_worker``) or retires them (no more
tasks, then ``None`` once idle; ``_retire_worker``). The ring and the status words are
sized for the most workers the tuner may use.
"""
from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from .attempts import Attempt
from .autotune import Meter, Tuner, memory_room, ring_workers
from .epochs import Epoch, Job, Stream
from ..plan.base import EMPTY, Failure, Offer, loaded
from ..errors import SharedMemoryError, TaskTimeoutError, WorkerError
from .faults import death_message, rebuild_error, skip_or_fail, startup_message, timeout_message
from ..core.messages import BatchDone, BatchFailed, Reply, SamplesSkipped, Task, WorkerFatal, WorkerReady
from .pool import Watchdog, WorkerLink, WorkerPool
from ..core.shm import Ring, SharedFiles, round_slot_bytes
from ..worker import fork_safety
from ..core.stats import EpochCounters, WorkerCounters, array_bytes, worker_baseline

logger = logging.getLogger("procpipe")
_new_tuple = tuple.__new__  # a Task without NamedTuple's argument handling (one per batch)

# Tasks a worker holds at once: one running, the others queued so it never waits for the
# next. Small batches are dominated by the round trip, so they get a deeper queue; large
# ones would only cost ring memory.
TASKS_PER_WORKER = 2
TASKS_PER_WORKER_SMALL = 4
SMALL_BATCH_BYTES = 1 << 20
_HEALTH_INTERVAL_S = 0.5  # how often worker memory is sampled
TIMEOUT_ATTEMPTS = 2  # attempts a batch may have at once, or time out on before the epoch fails


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
    stage_slots: int = 0  # slots a device stage may hold while its copies read them (Loader(device=...))


class Coordinator:
    """Starts the workers (through ``pool``) and runs the dispatch/reply loop in a daemon thread."""

    def __init__(self, config: EngineConfig, pool: WorkerPool, files: SharedFiles) -> None:
        self.config = config
        self.pool = pool
        self.files = files
        self.owner = os.getpid()  # the only process that may stop the workers or remove the files
        # deepened once the first batch shows it is small; a remote pool asks for its own depth
        self.tasks_per_worker = pool.tasks_per_worker or TASKS_PER_WORKER
        self.n_workers = config.workers  # workers given tasks (autotune changes it; retiring ones excluded)
        # The most workers at once: status words and worker indices are sized for it.
        self.capacity = config.workers if config.autotune is None else max(config.autotune.hard_max, config.workers)
        self.max_outstanding = config.prefetch + self.tasks_per_worker * config.workers
        # Speculative attempts need slots of their own, beyond those of the batches in flight.
        self.spare_slots = config.workers if config.speculate is not None else 0
        self.tuner: Tuner | None = None
        self._meter: Meter | None = None  # measures the tuner's control intervals
        if config.autotune is not None:
            self.tuner = Tuner(config.autotune, self.capacity, config.workers, time.monotonic())
            self._meter = Meter(config.autotune)
        self.ring: Ring | None = None  # the current ring (the latest generation)
        self._retired: list[Ring] = []  # earlier generations some of whose slots are still in use
        self._grow_failed = False  # a larger ring did not fit in shm_dir: overflows stay inline
        self._sized = False  # the ring was made (or the pool admitted the batch size)
        if config.slot_bytes is not None and pool.uses_ring:
            self._sized = True
            self._make_ring(config.slot_bytes)
        self.stream: Stream | None = None
        self.workers: list[WorkerLink] = []
        self.worker_counters: list[WorkerCounters] = []
        self._attempts: dict[int, Attempt] = {}
        self._next_attempt_id = 0
        self._watchdog = Watchdog(config.speculate, config.task_timeout)
        self._watching = config.speculate is not None or config.task_timeout is not None
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
        try:
            for i in range(config.workers):
                self.worker_counters.append(WorkerCounters())
                self.workers.append(self._start_worker(i))
        except BaseException:  # (the caller removes the files and closes the pool)
            self.pool.stop(self.workers)
            self._selector.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            raise
        self._last_health = 0.0
        # procpipe's own thread: it does not stop a later loader's start_method="auto" from forking
        self._thread = fork_safety.start_thread(self._run, "procpipe-coordinator")

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

    def foreign(self) -> bool:
        """This is a forked child of the loader's process: the engine is its parent's, not its own."""
        return os.getpid() != self.owner

    def autotune_info(self) -> dict[str, Any] | None:
        """``stats()["autotune"]``: None unless ``workers="auto"``."""
        return None if self.tuner is None else self.tuner.info(self.n_workers)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, end every worker, remove every shared file. Idempotent.

        The coordinator thread does the shutdown itself as it leaves its loop; if it is
        already gone (or this is that thread, e.g. a garbage collection running there),
        whatever is left is done here. In a forked child (its exit handlers, finalizers or
        an explicit close) it does nothing: the workers and files are the parent's.
        """
        if self.foreign():
            return
        self.submit("close")
        if threading.current_thread() is self._thread:
            return
        self._thread.join(timeout)
        self._shutdown_workers()

    # ---------------------------------------------------------------- workers
    def _start_worker(self, index: int) -> WorkerLink:
        """Start worker ``index``; the selector then reports its replies and its death."""
        link = self.pool.start(index, self.worker_counters[index])
        self._selector.register(link.reply_fd(), selectors.EVENT_READ, (self._on_readable, link))
        self._selector.register(link.exit_fd(), selectors.EVENT_READ, (self._on_exit, link))
        return link

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
        worker.stop_if_idle()
        self._flush(worker)
        return True

    def _set_outstanding(self) -> None:
        self.max_outstanding = self.config.prefetch + self.tasks_per_worker * self.n_workers

    def _tune(self, now: float) -> None:
        """Autotune: close a control interval (if long enough), ask the tuner, follow it."""
        stream = self.stream
        if stream is None or stream.finished or self.ring is None:
            stream = None  # between iterations (or before the first batch): nothing to measure
        sample = self._meter.measure(now, stream, self.workers, self.worker_counters)
        if sample is None:
            return
        tuner = self.tuner
        rss = max((w.counters.rss_bytes for w in self.workers), default=0)
        tuner.memory_room = memory_room(rss) if rss else None
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
        try:
            self.pool.stop(workers)
        finally:
            self.pool.close()
            self.files.remove_all()
        for ring in [self.ring, *self._retired]:
            if ring is not None:
                ring.close()
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
            wait = _HEALTH_INTERVAL_S
            if self._watching:
                wait = self._watchdog.look(self.workers, time.perf_counter(), _HEALTH_INTERVAL_S)
            if self.tuner is not None:
                now = time.monotonic()
                if now >= self._meter.next_at:
                    self._tune(now)
                wait = min(wait, max(0.001, self._meter.next_at - now))
            if self._retired:
                self._remove_idle_rings()
            self._dispatch()
            registered = self._selector.get_map()
            for key, _ in self._selector.select(wait):
                if registered.get(key.fd) is not key:
                    continue  # unregistered by an earlier callback of this round (its worker died)
                if key.data is None:
                    _drain(self._wake_r)
                else:
                    callback, handle = key.data
                    callback(handle)
            now = time.monotonic()
            if now - self._last_health >= _HEALTH_INTERVAL_S:
                self._last_health = now
                self.pool.sample_memory(self.workers)

    def _apply(self, command: str, *args: Any) -> None:
        if command == "start":
            if self.stream is not None:
                self.stream.abandon()
            stream = self.stream = args[0]
            stream.on_open = self._on_open
            stream.open(stream.first)
            for w in list(self.workers):
                if w.dead:  # it died past the previous epoch's budget: a fresh start
                    self._start_replacement(w)
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
            epoch.skips = epoch.skip_budget(self.config.max_skipped)
        epoch.counters.worker_base = worker_baseline(self.worker_counters)
        self._restarts_this_epoch = 0

    def _idle_worker(self) -> WorkerLink | None:
        """The healthy worker with the fewest tasks, if it can take one more."""
        best = None
        for w in self.workers:
            if not w.usable or w.stalled or len(w.tasks) >= self.tasks_per_worker:
                continue
            if best is None or len(w.tasks) < len(best.tasks):
                best = w
        return best

    def take_slot(self, epoch: Epoch) -> int | None:
        """A free ring slot for a task of ``epoch``, or None: no ring yet, or every slot is in
        use (the caller may then send the task with slot -1: its arrays come back through the
        pipe)."""
        ring = self.ring
        if ring is None or not ring.free:
            return None
        slot = ring.free.popleft()
        epoch.counters.peak_slots_in_use = max(epoch.counters.peak_slots_in_use, ring.slots - len(ring.free))
        return slot

    def _dispatch(self) -> None:
        """Send what may go now, for any source kind: the open epochs' plans offer tasks, best
        first (plan/base.py); each goes to a worker (its lane's, or the least loaded) with a ring
        slot. The stream opens the next epoch once the open ones have nothing new, so workers
        go on across the boundary."""
        stream = self.stream
        if stream is None or stream.finished:
            self.starved = False
            return
        self.starved = True  # published before looking, so a release after the look wakes us
        if self._watching:
            self._speculate()
        # Tasks in flight and batches not taken yet, counted once: only this thread adds to it
        # (the consumer may take batches meanwhile, which only makes the count high).
        outstanding = stream.outstanding()
        starved = False
        while not stream.finished:
            last = stream.fresh()  # opens the next epoch once the open ones have nothing new to dispatch
            for epoch in list(stream.epochs):
                while True:  # the earlier epoch first: its tasks to run again, then its new ones
                    sent, held_back = self._send_one(stream, epoch, outstanding)
                    starved = starved or held_back
                    if sent is None:
                        break
                    if sent:
                        outstanding += 1
            # Again only if the epoch that had new tasks has sent them all: the next one may open.
            if last is None or last.fresh or held_back:
                break
        self.starved = starved

    def _send_one(self, stream: Stream, epoch: Epoch, outstanding: int) -> tuple[bool | None, bool]:
        """Send ``epoch``'s best task that may go now: (None: none went, else whether it was a
        new one; whether one was held back for want of a slot, a worker or consumption)."""
        if epoch.finished:
            return None, False
        held_back = False
        for offer in epoch.offers(self.tasks_per_worker):
            worker = self._idle_worker() if offer.lane is None else self._worker_for(offer, epoch)
            if worker is None or len(worker.tasks) >= self.tasks_per_worker:
                held_back = True
                continue
            if offer.retry is not None:
                job = epoch.take(offer, worker.index)
                slot, job.slot = job.slot, -1  # it has the slot of its lost attempt
            else:
                if not offer.urgent and outstanding >= self.max_outstanding:
                    held_back = True
                    continue
                slot = self.take_slot(epoch)
                if slot is None:
                    # No free slot: before the ring exists (the first batches size it), or when
                    # the consumer holds every slot (e.g. list(loader)). Through the pipe, for
                    # the task the epoch waits for or an idle worker, keeps the pipeline moving
                    # instead of deadlocking; a busy worker has work meanwhile.
                    if self.pool.uses_ring and worker.tasks and not offer.urgent:
                        held_back = True
                        continue
                    slot = -1
                job = epoch.take(offer, worker.index)
            self.send(worker, job, slot)
            return offer.retry is None, held_back
        return None, held_back

    def _worker_for(self, offer: Offer, epoch: Epoch) -> WorkerLink | None:
        """The worker for ``offer``, which has a lane: the lane's (None while that one cannot take
        it), else (a lane not held yet, or its worker gone or retiring) the least loaded healthy
        one. (An offer without a lane goes to ``_idle_worker``.)"""
        if offer.worker is not None:
            for w in self.workers:
                if w.index == offer.worker:
                    if w.retiring:
                        break  # autotune is retiring it: the lane moves
                    return w if w.usable else None
        # The lane's first task, or its worker is gone: the worker with the fewest lanes takes it
        # (if it is not the lane's first task, that worker opens the shard again and skips ahead).
        load = epoch.plan.lanes_held()
        usable = [w for w in self.workers if w.usable]
        if not usable:
            return None
        return min(usable, key=lambda w: (load.get(w.index, 0), len(w.tasks), w.index))

    def send(self, worker: WorkerLink, job: Job, slot: int) -> None:
        """Send ``job`` to ``worker`` as a new attempt (in the task table), into ring slot
        ``slot`` (from ``take_slot``; -1: none)."""
        ring = self.ring
        if slot >= 0 and not ring.owns(slot):  # a re-run job's slot in a ring since replaced
            self._release(slot)
            slot = self.take_slot(job.epoch)
            slot = -1 if slot is None else slot
        started = None if worker.tasks or not worker.ready else time.perf_counter()  # else: when it starts it
        attempt = Attempt(self._next_attempt_id, job, worker, slot, started)
        self._next_attempt_id += 1
        self._attempts[attempt.id] = attempt
        worker.tasks[attempt.id] = attempt
        job.attempts.append(attempt)
        slot_bytes = ring.slot_bytes if slot >= 0 else 0
        ring_id = ring.ring_id if ring is not None else -1
        local = slot - ring.first_slot if slot >= 0 else -1
        # Never a blocking write (a large task to a worker busy in a slow sample would stall
        # the loop): what its pipe does not take now is written when it becomes writable.
        # A worker that is dying drops it; its sentinel fires and the task is redone.
        worker.put(_new_tuple(Task, (attempt.id, job.epoch.number, job.work.payload, ring_id, local, slot_bytes)))
        self._flush(worker)

    def _flush(self, worker: WorkerLink) -> None:
        """Send what ``worker``'s channel takes now; while some is left, the selector watches for room."""
        waiting = not worker.flush()
        if waiting and not worker.writing:
            self._selector.register(worker.write_fd(), selectors.EVENT_WRITE, (self._flush, worker))
        elif not waiting and worker.writing:
            self._selector.unregister(worker.write_fd())
        worker.writing = waiting

    # ---------------------------------------------------------------- stragglers
    def _speculate(self) -> None:
        """Give the batches held by straggling workers to healthy ones too; the first result wins."""
        for w in self.workers:
            if not w.stalled:
                continue
            for attempt in list(w.tasks.values()):
                job = attempt.job
                epoch = job.epoch
                if (job.done or epoch.finished or any(a.worker.healthy for a in job.attempts)
                        or len(job.attempts) + job.timeouts >= TIMEOUT_ATTEMPTS):
                    continue  # done, healthy elsewhere, or already tried as often as a batch may be
                target = self._idle_worker()
                if target is None:
                    return
                slot = self.take_slot(epoch) if self.ring is not None else -1
                if slot is None:
                    return
                epoch.counters.speculative_tasks += 1
                self.send(target, job, slot)  # (and a shard's later blocks follow, not behind the straggler:)
                epoch.moved(job, target.index)

    # ---------------------------------------------------------------- replies
    def _on_readable(self, worker: WorkerLink) -> None:
        """The selector saw replies: handle every one waiting."""
        replies = worker.read()
        if replies is None:  # the channel is closed: its death is handled by exit_fd
            try:
                self._selector.unregister(worker.reply_fd())
            except (KeyError, ValueError):
                pass  # its death was handled earlier in this select() round
            return
        for reply in replies:
            self._on_message(worker, reply)

    def _on_message(self, worker: WorkerLink, message: Reply) -> None:
        kind = type(message)
        if kind is not BatchDone and kind is not BatchFailed:  # (the common case first: a batch)
            self._on_notice(worker, message)
            return
        attempt = self._attempts.pop(message.task_id, None)
        worker.tasks.pop(message.task_id, None)
        if worker.retiring:
            worker.stop_if_idle()
            self._flush(worker)
        busy = message.busy_s
        worker.counters.tasks += 1
        worker.counters.busy_s += busy
        if self._watching:
            self._watchdog.finished(busy)
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
        if isinstance(message, BatchDone):
            self._on_batch(worker, attempt, message)
            return
        self._release_unused(attempt.slot)
        error = message.error
        if epoch.skips is None:
            epoch.result(job, Failure(rebuild_error(error, worker, job, epoch.number), batch_only=True))
        elif skip_or_fail(epoch, job, worker, attempt.skipped or [], error):
            epoch.result(job, EMPTY)

    def _on_notice(self, worker: WorkerLink, message: Reply) -> None:
        """A message that is not a batch's reply: a worker ready, a worker's fatal error, samples skipped."""
        if isinstance(message, WorkerReady):
            worker.ready = True
            if worker.tasks:  # its first task starts now, not when its process was started
                next(iter(worker.tasks.values())).started = time.perf_counter()
        elif isinstance(message, WorkerFatal):
            worker.fatal = message.traceback
        elif isinstance(message, SamplesSkipped):
            attempt = self._attempts.get(message.task_id)
            if attempt is not None:
                attempt.skipped = message.samples
        # (anything else, e.g. a remote pool's own WorkerLost, never reaches here)

    def _on_batch(self, worker: WorkerLink, attempt: Attempt, done: BatchDone) -> None:
        """A batch arrived for a job still waiting for it: deliver it (or its skips, or its error)."""
        job, epoch = attempt.job, attempt.job.epoch
        layout, nbytes = done.layout, done.nbytes
        skipped = len(attempt.skipped or ())
        if attempt.skipped and not skip_or_fail(epoch, job, worker, attempt.skipped, None):
            self._release_unused(attempt.slot)
            return
        if layout is None:  # every sample was skipped
            self._release_unused(attempt.slot)
            epoch.result(job, EMPTY)
            return
        if self.ring is None and not self._sized:
            slot_bytes = epoch.plan.slot_bytes(job.work, layout, nbytes, skipped)
            if slot_bytes is not None:
                self._size_for(slot_bytes)
        counters = epoch.counters
        if done.in_slot:
            lease = self._ring_of(attempt.slot).lease(attempt.slot, self._release)
            counters.bytes_in_slots += nbytes
        else:
            self._release_unused(attempt.slot)
            lease = None
            counters.bytes_inline += nbytes
            if attempt.slot >= 0:
                counters.overflow_batches += 1
                self._grow_ring(nbytes, counters)
        counters.array_bytes += array_bytes(layout)
        epoch.result(job, loaded(layout, lease, skipped))

    def _release_unused(self, slot: int) -> None:
        if slot >= 0:
            self._release(slot)

    def _release(self, slot: int) -> None:
        """Return a slot to its ring (runs in whichever thread drops a batch's last view)."""
        ring = self._ring_of(slot)
        if ring is not None:
            ring.free.append(slot)
            if self.starved and ring is self.ring:
                self.starved = False
                self.wake()

    def _ring_of(self, slot: int) -> Ring | None:
        """The ring (current or retired generation) slot number ``slot`` belongs to."""
        ring = self.ring
        if ring is None or ring.owns(slot):
            return ring
        for old in list(self._retired):  # (a copy: the coordinator thread may remove one meanwhile)
            if old.owns(slot):
                return old
        return None

    def _remove_idle_rings(self) -> None:
        """Remove retired rings whose slots have all come back (coordinator thread)."""
        for old in [r for r in self._retired if r.idle]:
            self._retired.remove(old)
            old.remove()

    def _grow_ring(self, nbytes: int, counters: EpochCounters) -> None:
        """A batch of ``nbytes`` did not fit its slot: replace the ring by one whose slots hold
        it with a margin (the old ring is retired, and removed once its slots are back), so
        later batches of that size go through the ring, not the pipes. If ``shm_dir`` has no
        room for it, the ring stays and such batches stay inline (with a warning).

        The new file is created and its pages populated here, on the coordinator thread:
        ``counters`` (``stats()["ring_growths"]``/``["ring_growth_s"]``) records the time."""
        old = self.ring
        if self._grow_failed or nbytes <= old.slot_bytes:
            return
        started = time.perf_counter()
        try:
            ring = Ring(self.files, old.ring_id + 1, old.slots, round_slot_bytes(nbytes + nbytes // 4),
                        old.first_slot + old.slots)
        except SharedMemoryError as exc:
            self._grow_failed = True
            self._warn_overflow(nbytes, f" A larger ring did not fit: {exc}")
            return
        finally:
            counters.ring_growth_s += time.perf_counter() - started
        counters.ring_growths += 1
        old.retired = True
        self._retired.append(old)
        self.ring = ring
        if old.idle:
            self._remove_idle_rings()

    def _make_ring(self, slot_bytes: int) -> None:
        """Create the ring, its slots sized for a full batch (from the first batch to arrive,
        its plan's ``slot_bytes``) or ``Loader(slot_bytes=)``."""
        if slot_bytes <= SMALL_BATCH_BYTES:
            self.tasks_per_worker = TASKS_PER_WORKER_SMALL
        self._set_outstanding()
        slot_bytes = round_slot_bytes(slot_bytes)
        workers = self.config.workers
        if self.tuner is not None:  # sized once, for the most workers the tuner may use
            per_worker = self.tasks_per_worker + (1 if self.config.speculate is not None else 0)
            workers = self.tuner.capacity = ring_workers(self.files.directory, slot_bytes, per_worker,
                                                         self.config.prefetch + 1, self.n_workers, self.capacity)
        if self.config.speculate is not None:
            self.spare_slots = workers
        # + the batch the consumer is working on
        slots = self.config.prefetch + self.tasks_per_worker * workers + 1 + self.spare_slots + self.config.stage_slots
        self.ring = Ring(self.files, 0, slots, slot_bytes)

    def _size_for(self, batch_bytes: int) -> None:
        """The first batch tells the size of a full one: make the ring (a pool whose workers
        write into it), or let the pool check that the batches in flight fit (a remote one)."""
        self._sized = True
        try:
            if self.pool.uses_ring:
                self._make_ring(batch_bytes)
            else:
                self.pool.admit(batch_bytes, self.max_outstanding)
        except BaseException as exc:
            self._broken = exc
            raise

    def _warn_overflow(self, nbytes: int, why: str) -> None:
        if not self._overflow_warned:
            import warnings

            self._overflow_warned = True
            warnings.warn(
                f"procpipe: a batch of {nbytes} bytes did not fit the ring's {self.ring.slot_bytes}-byte "
                f"slots and took the slower inline path.{why} Such batches keep taking it; pass "
                "slot_bytes=<largest batch> to Loader, or give shm_dir more room.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _fail(self, exc: BaseException) -> None:
        stream = self.stream
        if stream is not None and not stream.finished:
            stream.fail(exc)

    # ---------------------------------------------------------------- deaths
    def _on_exit(self, worker: WorkerLink) -> None:
        """A worker died (or was killed): re-run what it held, and replace it."""
        self._selector.unregister(worker.exit_fd())
        try:
            self._selector.unregister(worker.reply_fd())
        except (KeyError, ValueError):
            pass
        for reply in worker.read() or ():  # replies sent before it died: finished work is not redone
            self._on_message(worker, reply)
        if worker.writing:
            self._selector.unregister(worker.write_fd())
            worker.writing = False
        worker.reap()
        lost = list(worker.tasks.values())
        for attempt in lost:
            self._attempts.pop(attempt.id, None)
        worker.tasks.clear()
        if self._closing:
            return
        if worker.retiring:  # autotune retired it: it leaves for good
            self._meter.forget(worker.pid)
            if worker in self.workers:
                self.workers.remove(worker)
            if not lost:
                return
        killed_for = worker.killed_for or (lost[0] if lost else None)
        stuck_on = None if killed_for is None else worker.stuck_on(killed_for)
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
        for job in redo:
            job.epoch.lost(job)
        if timed_out is not None:
            self._fail(TaskTimeoutError(timeout_message(timed_out, stuck_on, self.config.task_timeout,
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
        if worker.failed_to_start():
            # It failed before reaching any user code: restarting would fail the same way.
            self._broken = WorkerError(startup_message(worker, self.config.start_method))
            self._fail(self._broken)
            return
        if worker.killed_for is None and worker.counts_as_restart:  # it died by itself: that counts
            if self._restarts_this_epoch >= self.config.max_worker_restarts:
                self._fail(WorkerError(death_message(worker, lost, stuck_on, self.config.max_worker_restarts)))
                worker.dead = True  # no restart (a crash loop must not spin between epochs)
                return
            self._restarts_this_epoch += 1
        worker.counters.restarts += 1
        self._start_replacement(worker)

    def _start_replacement(self, worker: WorkerLink) -> None:
        """Start ``worker``'s replacement. A pool that cannot (a remote pool past its budget of
        lost nodes) leaves it dead: the others go on with its work, and the next epoch tries
        again; only when no worker is left does the error end the iteration."""
        try:
            self.workers[self.workers.index(worker)] = self._start_worker(worker.index)
        except Exception as exc:  # noqa: BLE001 - the pool's verdict, given to the user below
            worker.dead = True
            if any(w.usable for w in self.workers):
                logger.warning("procpipe: %s could not be replaced (%s); the other "
                               "workers take its batches", worker.describe(), exc)
                return
            self._broken = exc
            self._fail(exc)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass

