"""``Delivery``: the reply path. A worker's replies become batches (views of their ring
slot), skips or errors of their epoch; the first batch sizes the ring.

Every batch passes through ``on_readable`` and ``on_message`` once, on the coordinator
thread: they build nothing but the batch itself, and read their collaborators from
attributes set once. A reply of an attempt that lost its race (speculation, a re-run
after a death) or of a cancelled epoch only gives its slot back.
"""

from __future__ import annotations

import selectors
import time
import warnings
from typing import TYPE_CHECKING

from .._core.messages import BatchDone, BatchFailed, Reply, SamplesSkipped, WorkerFatal, WorkerReady
from .._core.rings import round_slot_bytes
from .._core.stats import array_bytes
from .._sources.epoch_plan import EMPTY, Failure, loaded
from .autotune import ring_workers
from .faults import rebuild_error, skip_or_fail
from .pool import Watchdog, WorkerLink, WorkerPool

if TYPE_CHECKING:
    from .._core.rings import RingSet
    from ..config import EngineConfig
    from .attempts import Attempt
    from .autotune import Tuner
    from .dispatch import Dispatcher
    from .roster import Roster

TASKS_PER_WORKER_SMALL = 4  # tasks a worker holds when batches are small (the round trip dominates)
SMALL_BATCH_BYTES = 1 << 20


class Delivery:
    """Handles replies for the coordinator (``on_readable`` is a selector callback)."""

    def __init__(
        self,
        config: EngineConfig,
        pool: WorkerPool,
        dispatcher: Dispatcher,
        watchdog: Watchdog | None,
        tuner: Tuner | None,
        selector: selectors.BaseSelector,
    ) -> None:
        self.config = config
        self.pool = pool
        self.dispatcher = dispatcher
        self.roster: Roster = dispatcher.roster
        self.rings: RingSet = dispatcher.rings
        self.attempts: dict[int, Attempt] = dispatcher.attempts
        self.watchdog = watchdog  # None unless speculate= or task_timeout=
        self.tuner = tuner
        self.selector = selector
        self.flush = dispatcher.flush
        self.sized = False  # the ring was made (or the pool admitted the batch size)
        # Speculative attempts need slots of their own, beyond those of the batches in flight.
        self.spare_slots = config.workers if config.faults.speculate is not None else 0
        self.overflow_warned = False
        self.reserved = 0  # spare slots a stage of procpipe's holds batches in (ReserveSlots), beyond stage_slots

    # ---------------------------------------------------------------- replies
    def on_readable(self, worker: WorkerLink) -> None:
        """The selector saw replies: handle every one waiting."""
        replies = worker.read()
        if replies is None:  # the channel is closed: its death is handled by exit_fd
            try:
                self.selector.unregister(worker.reply_fd())
            except (KeyError, ValueError):
                pass  # its death was handled earlier in this select() round
            return
        for reply in replies:
            self.on_message(worker, reply)

    def on_message(self, worker: WorkerLink, message: Reply) -> None:
        kind = type(message)
        if kind is not BatchDone and kind is not BatchFailed:  # (the common case first: a batch)
            self.on_notice(worker, message)
            return
        task_id = message.task_id  # type: ignore[union-attr]
        attempt = self.attempts.pop(task_id, None)
        worker.tasks.pop(task_id, None)
        if worker.retiring:
            worker.stop_if_idle()
            self.flush(worker)
        busy = message.busy_s  # type: ignore[union-attr]
        counters = worker.counters
        counters.tasks += 1
        counters.busy_s += busy
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.finished(busy)
            worker.stalled = False
            if worker.tasks:  # the worker starts its queued task now
                next(iter(worker.tasks.values())).started = time.perf_counter()
        if attempt is None:
            return
        job = attempt.job
        job.attempts.remove(attempt)
        epoch = job.epoch
        if job.done or epoch.finished:
            self.rings.release_unused(attempt.slot)  # a lost race, or a cancelled epoch
            return
        job.done = True
        if kind is BatchDone:
            self.on_batch(worker, attempt, message)  # type: ignore[arg-type]
            return
        self.rings.release_unused(attempt.slot)
        error = message.error  # type: ignore[union-attr]
        if epoch.skips is None:
            epoch.result(job, Failure(rebuild_error(error, worker, job, epoch.number), batch_only=True))
        elif skip_or_fail(epoch, job, worker, attempt.skipped or [], error):
            epoch.result(job, EMPTY)

    def on_notice(self, worker: WorkerLink, message: Reply) -> None:
        """A message that is not a batch's reply: a worker ready, a worker's fatal error, samples skipped."""
        if isinstance(message, WorkerReady):
            self.roster.mark_ready(worker)
            if worker.tasks:  # its first task starts now, not when its process was started
                next(iter(worker.tasks.values())).started = time.perf_counter()
        elif isinstance(message, WorkerFatal):
            self.roster.mark_fatal(worker, message.traceback)
        elif isinstance(message, SamplesSkipped):
            attempt = self.attempts.get(message.task_id)
            if attempt is not None:
                attempt.skipped = message.samples
        # (anything else, e.g. a remote pool's own WorkerLost, never reaches here)

    def on_batch(self, worker: WorkerLink, attempt: Attempt, done: BatchDone) -> None:
        """A batch arrived for a job still waiting for it: deliver it (or its skips, or its error)."""
        job = attempt.job
        epoch = job.epoch
        layout, nbytes = done.layout, done.nbytes
        rings = self.rings
        skipped = len(attempt.skipped or ())
        if attempt.skipped and not skip_or_fail(epoch, job, worker, attempt.skipped, None):
            rings.release_unused(attempt.slot)
            return
        if layout is None:  # every sample was skipped
            rings.release_unused(attempt.slot)
            epoch.result(job, EMPTY)
            return
        if not self.sized:
            slot_bytes = epoch.plan.slot_bytes(job.work, layout, nbytes, skipped)
            if slot_bytes is not None:
                self.size_for(slot_bytes)
        counters = epoch.counters
        if done.in_slot:
            lease = rings.ring_of(attempt.slot).lease(attempt.slot, rings.release)  # type: ignore[union-attr]
            counters.bytes_in_slots += nbytes
        else:
            rings.release_unused(attempt.slot)
            lease = None
            counters.bytes_inline += nbytes
            if attempt.slot >= 0:
                counters.overflow_batches += 1
                why = rings.grow(nbytes, counters)
                if why is not None:
                    self.warn_overflow(nbytes, why)
        counters.array_bytes += array_bytes(layout)
        epoch.result(job, loaded(layout, lease, skipped))

    # ---------------------------------------------------------------- sizing the ring
    def make_ring(self, slot_bytes: int) -> None:
        """Create the ring, its slots sized for a full batch (from the first batch to arrive,
        its plan's ``slot_bytes``) or ``Loader(slot_bytes=)``."""
        config, roster = self.config, self.roster
        self.sized = True
        if slot_bytes <= SMALL_BATCH_BYTES:
            roster.tasks_per_worker = TASKS_PER_WORKER_SMALL
        self.dispatcher.set_outstanding()
        slot_bytes = round_slot_bytes(slot_bytes)
        workers = config.workers
        if self.tuner is not None:  # sized once, for the most workers the tuner may use
            per_worker = roster.tasks_per_worker + (1 if config.faults.speculate is not None else 0)
            workers = self.tuner.capacity = ring_workers(
                self.rings.segments.directory,
                slot_bytes,
                per_worker,
                config.prefetch + 1,
                roster.n_workers,
                roster.capacity,
            )
        if config.faults.speculate is not None:
            self.spare_slots = workers
        # + the batch the consumer is working on
        slots = config.prefetch + roster.tasks_per_worker * workers + 1 + self.spare_slots + config.stage_slots
        self.rings.make(slots + self.reserved, slot_bytes)

    def reserve(self, slots: int) -> None:
        """Keep at least ``slots`` slots spare for a stage of procpipe's that holds batches as ring
        views (``procpipe.tf.dataset``: TensorFlow lets go of them late), so that its batches are
        not taken from the workers' share: counted in when the ring is made, or added to the
        ring now (a new generation with more slots; the old one goes once its slots are back)."""
        extra = slots - self.reserved
        if extra <= 0:
            return
        self.reserved = slots
        if self.rings.current is not None:
            why = self.rings.add_slots(extra)
            if why is not None:
                warnings.warn(
                    f"procpipe: could not add {extra} ring slots for a stage that holds batches ({why}); its "
                    "batches share the workers' slots. Give the process more memory (or shm_dir more room), or pass "
                    "stage_slots= to Loader.",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def size_for(self, batch_bytes: int) -> None:
        """The first batch tells the size of a full one: make the ring (a pool whose workers
        write into it), or let the pool check that the batches in flight fit (a remote one)."""
        self.sized = True
        if self.pool.uses_ring:
            self.make_ring(batch_bytes)
        else:
            self.pool.admit(batch_bytes, self.dispatcher.max_outstanding)

    def warn_overflow(self, nbytes: int, why: str) -> None:
        if not self.overflow_warned:
            self.overflow_warned = True
            slot_bytes = self.rings.current.slot_bytes  # type: ignore[union-attr]
            warnings.warn(
                f"procpipe: a batch of {nbytes} bytes did not fit the ring's {slot_bytes}-byte "
                f"slots and took the slower inline path.{why} Such batches keep taking it; pass "
                "slot_bytes=<largest batch> to Loader, or give the process more memory (or shm_dir more room).",
                RuntimeWarning,
                stacklevel=2,
            )
