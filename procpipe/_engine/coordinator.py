"""The coordinator: a background thread in the consumer's process that drives the workers.

The data path, top to bottom: the consumer's ``iter(loader)`` (loader.py; its epoch
iterator, _consumer/epoch_iterator.py) hands an ``Iteration`` of epochs and their batches (epochs.py) to
this thread, which sends each batch to a worker process (started by pool.py; _worker/process.py
runs in it). The worker writes the collated batch into a ring slot (shm.py, collate.py) and
replies with its layout; here the reply becomes a batch of views of that slot, which the
epoch passes through reassembly (reassembly.py) into the iteration's queue the consumer reads.

The coordinator is a loop of named steps over parts, each in its own module:

- ``RingSet`` (_core/rings.py): the ring generations and their slot free lists;
- ``Roster`` (roster.py): the workers, their counters and states, who gets the next task;
- ``Dispatcher`` (dispatch.py): the dispatch round, speculation, the task table;
- ``settle`` (deaths.py): what a worker's death means (re-runs, timeouts, restart or fail);
- typed commands from the consumer (commands.py) and a ``WakePipe`` (_core/wakeup.py).

Its loop (``_loop``)::

    apply commands      start a iteration, cancel it, close
    safe point          nothing in flight is half-handled here (a fork gate parks here)
    watch               stragglers (speculate=...) and stuck workers (task_timeout=...)
    autotune            workers="auto": start or retire workers
    dispatch            one task per free slot, a few per worker (one running, the rest queued)
    wait and handle     epoll: a reply on a worker's pipe, a worker's death, a wake-up byte
    check health        every half second: worker memory, and deaths the selector missed

It sleeps in ``select`` whenever there is nothing to do: no competing for the GIL.

Fault tolerance. A batch of the epoch is a ``Job``; each time it is sent to a worker is
an ``Attempt``, with its own ring slot. A job normally has one attempt; it gets another
when its worker dies (the job is re-run from the start: samples are deterministic from
``(seed, epoch, index)``, so the result is the same), when it straggles (``speculate``:
a copy runs on a healthy worker), or when its worker is killed after ``task_timeout``.
The first attempt to finish delivers the batch; any other is discarded when it replies
(or dies), and its slot returns to the ring. Reassembly refuses a position twice, so no
batch is ever delivered twice. What the consumer is told of a failure: faults.py.

Autotune. With ``workers="auto"`` a ``Tuner`` (policy.py) is consulted every control
interval; the coordinator starts workers or retires them (no more tasks, then ``None``
once idle). The ring and the status words are sized for the most workers the tuner may use.
Auto-tuned loaders with local workers share the node's CPUs through a small file in
``shm_dir`` or ``/dev/shm`` (_core/nodeshare.py), written about once a second without waiting for its lock.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections import deque
from typing import Any

from .._core.nodeshare import NodeShare, node_directory
from .._core.rings import Ring, RingSet
from .._core.shm import Segments
from .._core.stale_files import sweep_once
from .._core.stats import WorkerCounters, worker_baseline
from .._core.wakeup import WakePipe
from .._worker import fork_safety
from ..config import EngineConfig
from ..errors import TaskTimeoutError, WorkerError
from .autotune import Meter, Tuner, cpu_count, memory_room
from .commands import CancelIteration, CloseEngine, Command, ReserveSlots, StartIteration, checked
from .deaths import Next, settle
from .delivery import SMALL_BATCH_BYTES, TASKS_PER_WORKER_SMALL, Delivery
from .dispatch import TIMEOUT_ATTEMPTS, Dispatcher
from .epochs import Epoch, Iteration
from .faults import death_message, startup_message, timeout_message
from .pool import Watchdog, WorkerLink, WorkerPool
from .roster import Roster

__all__ = [
    "SMALL_BATCH_BYTES",
    "TASKS_PER_WORKER",
    "TASKS_PER_WORKER_SMALL",
    "TIMEOUT_ATTEMPTS",
    "Coordinator",
    "EngineConfig",
]

logger = logging.getLogger("procpipe")

# Tasks a worker holds at once: one running, the others queued so it never waits for the
# next. Small batches are dominated by the round trip, so they get a deeper queue; large
# ones would only cost ring memory (TASKS_PER_WORKER_SMALL, SMALL_BATCH_BYTES: delivery.py).
TASKS_PER_WORKER = 2
_HEALTH_INTERVAL_S = 0.5  # how often worker memory is sampled and the workers are asked whether they ended


class Coordinator:
    """Starts the workers (through ``pool``) and runs the dispatch/reply loop in a daemon thread."""

    def __init__(self, config: EngineConfig, pool: WorkerPool, segments: Segments) -> None:
        self.config = config
        self.pool = pool
        self.segments = segments
        self.owner = os.getpid()  # the only process that may stop the workers or remove the files
        # The most workers at once: status words and worker indices are sized for it.
        capacity = config.workers if config.autotune is None else max(config.autotune.hard_max, config.workers)
        # deepened once the first batch shows it is small; a remote pool asks for its own depth
        self.roster = Roster(pool, capacity, config.workers, pool.tasks_per_worker or TASKS_PER_WORKER)
        self._wakeup = WakePipe()
        self.rings = RingSet(segments, self._wakeup)
        self.dispatcher = Dispatcher(self.roster, self.rings, pool.uses_ring, config.prefetch, self._flush)
        self._attempts = self.dispatcher.attempts  # (the same table)
        self.tuner: Tuner | None = None
        self._meter: Meter | None = None  # measures the tuner's control intervals
        self._node: NodeShare | None = None  # this loader's line in the node's CPU file (local workers)
        if config.autotune is not None:
            auto = config.autotune
            cpus = cpu_count()
            self.tuner = Tuner(auto.min, auto.hard_max, capacity, config.workers, time.monotonic(), cpus)
            self._meter = Meter(auto)
            if pool.uses_ring:
                node_dir = segments.directory
                if node_dir is None:  # (a loader with an shm_dir swept it as it made its segments)
                    node_dir = node_directory()
                    sweep_once(node_dir)
                self._node = NodeShare(node_dir, cpus)
        self.iteration: Iteration | None = None
        self._watchdog = Watchdog(config.faults.speculate, config.faults.task_timeout)
        self._watching = config.faults.speculate is not None or config.faults.task_timeout is not None
        self._selector = selectors.DefaultSelector()
        self.delivery = Delivery(
            config, pool, self.dispatcher, self._watchdog if self._watching else None, self.tuner, self._selector
        )
        if config.slot_bytes is not None and pool.uses_ring:
            self.delivery.make_ring(config.slot_bytes)
        self._restarts_this_epoch = 0
        self._broken: BaseException | None = None
        self._overflow_warned = False
        self._commands: deque[Command] = deque()
        self._closing = False
        self._shut_down = False
        self._selector.register(self._wakeup.fileno(), selectors.EVENT_READ, None)
        try:
            for i in range(config.workers):
                self.roster.links.append(self._start_worker(i))
        except BaseException:  # (the caller removes the files and closes the pool)
            self.pool.stop(self.roster.links)
            self._selector.close()
            self._wakeup.close()
            raise
        self._last_health = 0.0
        # procpipe's own thread: it does not stop a later loader's start_method="auto" from forking
        self._thread = fork_safety.start_thread(self._run, "procpipe-coordinator")

    # ---------------------------------------------------------------- what others read
    @property
    def workers(self) -> list[WorkerLink]:
        """The workers (``WorkerLink``), retiring ones included."""
        return self.roster.links

    @property
    def worker_counters(self) -> list[WorkerCounters]:
        """Each worker index's counters, kept across restarts."""
        return self.roster.counters

    @property
    def n_workers(self) -> int:
        """Workers given tasks (autotune changes it; retiring ones excluded)."""
        return self.roster.n_workers

    @property
    def capacity(self) -> int:
        return self.roster.capacity

    @property
    def tasks_per_worker(self) -> int:
        return self.roster.tasks_per_worker

    @property
    def max_outstanding(self) -> int:
        return self.dispatcher.max_outstanding

    @property
    def ring(self) -> Ring | None:
        """The current ring (the latest generation); None before the first batch sizes it."""
        return self.rings.current

    @property
    def starved(self) -> bool:
        """The coordinator found nothing to send: a freed slot or a consumed batch wakes it."""
        return self._wakeup.starved

    # ---------------------------------------------------------------- consumer side
    def submit(self, command: Command) -> None:
        """Queue a command (commands.py: ``StartIteration``, ``CancelIteration``, ``ReserveSlots``, ``CloseEngine``) for
        the coordinator thread and wake it; anything else is a ``TypeError``."""
        self._commands.append(checked(command))
        self._wakeup.wake()

    def wake(self) -> None:
        self._wakeup.wake()

    def consumed_one(self, iteration: Iteration, epoch: Epoch, seq: int) -> None:
        epoch.mark_consumed(seq)
        iteration.consumed += 1
        wakeup = self._wakeup
        if wakeup.starved:
            wakeup.wake_if_starved()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def foreign(self) -> bool:
        """This is a forked child of the loader's process: the engine is its parent's, not its own."""
        return os.getpid() != self.owner

    def autotune_info(self) -> dict[str, Any] | None:
        """``stats()["autotune"]``: None unless ``workers="auto"``."""
        return None if self.tuner is None else self.tuner.info(self.roster.n_workers)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, end every worker, remove every shared file. Idempotent.

        The coordinator thread does the shutdown itself as it leaves its loop; if it is
        already gone (or this is that thread, e.g. a garbage collection running there),
        whatever is left is done here. In a forked child (its exit handlers, finalizers or
        an explicit close) it does nothing: the workers and files are the parent's.
        """
        if self.foreign():
            return
        self.submit(CloseEngine())
        if threading.current_thread() is self._thread:
            return
        self._thread.join(timeout)
        self._shutdown_workers()

    # ---------------------------------------------------------------- the loop
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - a bug here must reach the consumer, not hang it
            self._broken = exc
            self._fail(exc)
        finally:
            if self.iteration is not None:
                self.iteration.publish()  # what its last round held back
            if self._closing:
                self._shutdown_workers()

    def _loop(self) -> None:
        """The manager loop: one named step after another, until closed."""
        while True:
            if self._commands:
                self._apply_commands()
            if self._closing:
                return
            wait = self._watch() if self._watching else _HEALTH_INTERVAL_S
            if self.tuner is not None:
                wait = self._autotune(wait)
            if self.rings.retired:
                self.rings.remove_idle()
            self._dispatch()
            self._wait_and_handle(wait)
            self._check_health()

    def _apply_commands(self) -> None:
        """Step: apply the consumer's commands, in order."""
        commands = self._commands
        while commands:
            command = commands.popleft()
            if isinstance(command, StartIteration):
                self._start_iteration(command.iteration)
            elif isinstance(command, CancelIteration):
                if self.iteration is not None and self.iteration.gen == command.gen:
                    self.iteration.abandon()
            elif isinstance(command, ReserveSlots):
                self.delivery.reserve(command.slots)
            else:  # CloseEngine
                self._closing = True
                if self.iteration is not None:
                    self.iteration.abandon()

    def _watch(self) -> float:
        """Step: mark stragglers (speculate), kill workers stuck past task_timeout; the wait."""
        return self._watchdog.look(self.roster.links, time.perf_counter(), _HEALTH_INTERVAL_S)

    def _autotune(self, wait: float) -> float:
        """Step: at the end of a control interval, ask the tuner and follow it."""
        meter = self._meter
        now = time.monotonic()
        if now >= meter.next_at:  # type: ignore[union-attr]
            self._tune(now)
        return min(wait, max(0.001, meter.next_at - now))  # type: ignore[union-attr]

    def _dispatch(self) -> None:
        """Step: send what may go now (dispatch.py); with nothing sent for want of capacity,
        a freed slot or a consumed batch wakes the loop."""
        iteration = self.iteration
        wakeup = self._wakeup
        if iteration is None or iteration.finished:
            wakeup.starved = False
            return
        wakeup.starved = True  # published before looking, so a release after the look wakes us
        if self._watching:
            self.dispatcher.speculate()
        wakeup.starved = self.dispatcher.round(iteration)

    def _wait_and_handle(self, wait: float) -> None:
        """Step: sleep in select for at most ``wait`` s; handle each reply, death and wake-up."""
        selector = self._selector
        registered = selector.get_map()
        iteration = self.iteration
        if iteration is not None and iteration.pending:
            iteration.publish()  # the round's batches, now that its tasks are sent (Iteration.publish)
        for key, _ in selector.select(wait):
            if registered.get(key.fd) is not key:
                continue  # unregistered by an earlier callback of this round (its worker died)
            if key.data is None:
                self._wakeup.drain()
            else:
                callback, handle = key.data
                callback(handle)

    def _check_health(self) -> None:
        """Step: every half second, the workers' memory, and deaths their exit descriptor missed."""
        now = time.monotonic()
        if now - self._last_health >= _HEALTH_INTERVAL_S:
            self._last_health = now
            self.pool.sample_memory(self.roster.links)
            self._find_unseen_deaths()

    def _find_unseen_deaths(self) -> None:
        """A worker that has ended (``exitcode`` set) while its exit descriptor never became
        readable is handled as a death here. The descriptor stays silent when a copy of the
        end that closes at exit leaked into another process: a fork in a thread of the
        program (its own ``multiprocessing``, a subprocess) at the instant a worker was
        started. The worker's death would otherwise go unseen for as long as that process
        lives, and its batches would never come."""
        on_exit = self._on_exit
        watched = [key.data[1] for key in self._selector.get_map().values() if key.data and key.data[0] == on_exit]
        for link in watched:  # (a death handled already is no longer watched)
            if link.exitcode is not None:
                on_exit(link)

    # ---------------------------------------------------------------- streams and epochs
    def _start_iteration(self, iteration: Iteration) -> None:
        if self.iteration is not None:
            self.iteration.abandon()
        self.iteration = iteration
        iteration.pending = []  # (published before each wait: _wait_and_handle)
        iteration.on_open = self._on_open
        iteration.open(iteration.first)
        for w in list(self.roster.links):
            if w.dead:  # it died past the previous epoch's budget: a fresh start
                self._start_replacement(w)
        if self._broken is not None:
            self._fail(self._broken)

    def _on_open(self, epoch: Epoch) -> None:
        """A iteration opened ``epoch`` (coordinator thread): its per-epoch budgets and baselines."""
        epoch.on_drop = self.rings.release
        if self.config.faults.on_error == "skip":
            epoch.skips = epoch.skip_budget(self.config.faults.max_skipped)
        epoch.counters.worker_base = worker_baseline(self.roster.counters)
        self._restarts_this_epoch = 0

    def _fail(self, exc: BaseException) -> None:
        iteration = self.iteration
        if iteration is not None and not iteration.finished:
            iteration.fail(exc)
            iteration.publish()  # (now: the coordinator may be on its way out)

    # ---------------------------------------------------------------- workers
    def _start_worker(self, index: int) -> WorkerLink:
        """Start worker ``index``; the selector then reports its replies and its death."""
        link = self.roster.start(index)
        self._selector.register(link.reply_fd(), selectors.EVENT_READ, (self.delivery.on_readable, link))
        self._selector.register(link.exit_fd(), selectors.EVENT_READ, (self._on_exit, link))
        return link

    def _flush(self, worker: WorkerLink) -> None:
        """Send what ``worker``'s channel takes now; while some is left, the selector watches for room."""
        waiting = not worker.flush()
        if waiting and not worker.writing:
            self._selector.register(worker.write_fd(), selectors.EVENT_WRITE, (self._flush, worker))
        elif not waiting and worker.writing:
            self._selector.unregister(worker.write_fd())
        worker.writing = waiting

    def _tune(self, now: float) -> None:
        """Autotune: close a control interval (if long enough), ask the tuner, follow it."""
        iteration = self.iteration
        if iteration is None or iteration.finished or self.rings.current is None:
            iteration = None  # between iterations (or before the first batch): nothing to measure
        roster = self.roster
        tuner = self.tuner
        assert tuner is not None
        starting = any(not (w.ready or w.retiring or w.dead) for w in roster.links)
        sample = self._meter.measure(now, iteration, roster.links, roster.counters, starting)  # type: ignore[union-attr]
        node = self._node
        if node is not None and (sample is not None or node.due()):
            # the node's CPUs, shared with the other auto-tuned loaders there (never waits for the lock)
            tuner.cpus = node.update(tuner.want_cpus() if iteration is not None else 0.0)
            tuner.shared = node.peers > 1
        if sample is None:
            return
        rss = max((w.counters.rss_bytes for w in roster.links), default=0)
        tuner.memory_room = memory_room(rss) if rss else None
        target = tuner.step(now, sample)
        while roster.n_workers < target:
            index = roster.free_index()
            if index is None:
                break
            roster.links.append(self._start_worker(index))
            roster.n_workers += 1
            self.dispatcher.set_outstanding()
        while roster.n_workers > target:
            worker = roster.to_retire()
            if worker is None:
                break
            roster.retire(worker)
            self.dispatcher.set_outstanding()
            self._flush(worker)
        tuner.workers = roster.n_workers

    def _shutdown_workers(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        if self._node is not None:
            self._node.leave()
        workers, self.roster.links = self.roster.links, []
        try:
            self.pool.stop(workers)
        finally:
            self.pool.close()
            self.segments.remove_all()
        self.rings.close()
        self._wakeup.close()  # a late wake() (a batch dropped after close) is now ignored
        self._selector.close()

    # ---------------------------------------------------------------- deaths
    def _on_exit(self, worker: WorkerLink) -> None:
        """A worker died (or was killed): re-run what it held (deaths.py), and replace it."""
        try:
            self._settle_exit(worker)
        finally:
            # The attempt it was killed for points back at it (Attempt.worker): a cycle that
            # would keep the dead link, its pipe buffers and whatever it holds until a
            # garbage collection. Its death is settled: nothing asks for the attempt again.
            worker.killed_for = None

    def _settle_exit(self, worker: WorkerLink) -> None:
        selector = self._selector
        selector.unregister(worker.exit_fd())
        try:
            selector.unregister(worker.reply_fd())
        except (KeyError, ValueError):
            pass
        for reply in worker.read() or ():  # replies sent before it died: finished work is not redone
            self.delivery.on_message(worker, reply)
        if worker.writing:
            selector.unregister(worker.write_fd())
            worker.writing = False
        worker.reap()
        lost = list(worker.tasks.values())
        for attempt in lost:
            self._attempts.pop(attempt.id, None)
        worker.tasks.clear()
        if self._closing:
            return
        if worker.retiring:  # autotune retired it: it leaves for good
            self._meter.forget(worker.pid)  # type: ignore[union-attr,arg-type]
            self.roster.remove(worker)
            if not lost:
                return
        iteration = self.iteration
        if iteration is not None:
            counters = iteration.current_counters()
            if counters is not None:
                counters.worker_deaths += 1
        death = settle(
            worker, lost, self.rings.release, self._restarts_this_epoch, self.config.faults.max_worker_restarts
        )
        for job in death.redo:
            job.epoch.lost(job)
        timed_out = death.timed_out
        if timed_out is not None:
            self._fail(
                TaskTimeoutError(
                    timeout_message(timed_out, death.stuck_on, self.config.faults.task_timeout, timed_out.epoch.number),
                    death.stuck_on,
                )
            )
        step = death.next
        if step is Next.GONE:
            return
        if step is Next.FATAL:
            self._broken = WorkerError(
                f"procpipe worker {worker.index} could not start: loading the dataset, fn or collate_fn "
                f"failed in the worker process.\n{worker.fatal}"
            )
            self._fail(self._broken)
            return
        if step is Next.CANNOT_START:  # it failed before reaching any user code
            self._broken = WorkerError(startup_message(worker, self.config.start_method))
            self._fail(self._broken)
            return
        if step is Next.OVER_BUDGET:
            self._fail(WorkerError(death_message(worker, lost, death.stuck_on, self.config.faults.max_worker_restarts)))
            self.roster.mark_dead(worker)  # no restart (a crash loop must not spin between epochs)
            return
        if death.counts:
            self._restarts_this_epoch += 1
        worker.counters.restarts += 1
        self._start_replacement(worker)

    def _start_replacement(self, worker: WorkerLink) -> None:
        """Start ``worker``'s replacement. A pool that cannot (a remote pool past its budget of
        lost nodes) leaves it dead: the others go on with its work, and the next epoch tries
        again; only when no worker is left does the error end the iteration."""
        try:
            self.roster.replace(worker, self._start_worker(worker.index))
        except Exception as exc:  # noqa: BLE001 - the pool's verdict, given to the user below
            self.roster.mark_dead(worker)
            if self.roster.any_usable():
                logger.warning(
                    "procpipe: %s could not be replaced (%s); the other workers take its batches",
                    worker.describe(),
                    exc,
                )
                return
            self._broken = exc
            self._fail(exc)
