"""Epochs and streams: what the coordinator and the consumer share about an iteration's batches.

One ``iter(loader)`` is an ``Iteration``: one epoch (the default), N epochs or endless
(``Loader(epochs=...)``). Each ``Epoch`` holds its source kind's ``EpochPlan`` (_sources/epoch_plan.py:
``IndexPlan`` for indexed sources, ``_sources.stream.ShardPlan`` for shards), which says which
tasks the epoch holds and what their results become; the ``Epoch`` itself is the same for
every kind. Each task sent is a ``Job``, and each time a job is sent to a worker is an
``Attempt`` (attempts.py: normally one; more when a worker dies, straggles or times out,
see coordinator.py). The coordinator thread takes the plans' offers, turns the replies
into results and hands them to ``Epoch.result``; the plan turns them into batches in
their order, which go into the iteration's queue, ``out``, that the consumer's iterator
reads (_consumer/epoch_iterator.py). With ``workers=0`` the Loader drives the same kind of iteration in
the consumer's thread, for every source kind (_consumer/inline.py ``InlineDriver``).

The iteration opens the next epoch as soon as every task of the open ones has been
dispatched, so workers keep working across the epoch boundary; each epoch keeps its own
plan, counters and progress, and all of them feed one queue, tagged with their
epoch. Besides batches, the queue carries markers: ``EpochEnd`` after each epoch,
``EndOfIteration`` after the iteration, and a ``Failure`` that ends it. A batch whose user code
raised is a ``Failure(..., batch_only=True)`` in its place: the consumer raises it and
the iteration goes on with the next batch (as torch's DataLoader does).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from .._core.notes import add_note
from .._core.reassembly import ResumePoint
from .._core.skips import SkipBudget
from .._core.stats import EpochCounters
from .._sources.epoch_plan import EMPTY, EpochPlan, Failure, Offer, Work

__all__ = ["EMPTY", "EndOfIteration", "Epoch", "EpochEnd", "Failure", "Iteration", "Job", "iteration_over"]


class EpochPlanClass(Protocol):
    """A source kind's ``EpochPlan`` class: built once per epoch (``EpochPlan`` declares no
    constructor; ``IndexPlan`` and ``ShardPlan`` share this one)."""

    def __call__(self, order: Any, number: int, batches: Any, ordered: bool, resumed: Any, /) -> EpochPlan: ...

    def unopened_state(self, resumed: Any) -> Any: ...


def iteration_over(cancelled: str | None) -> NoReturn:
    """What ``next()`` does on an epoch iterator that has ended: say why if it was ended early."""
    if cancelled:
        raise RuntimeError(f"this epoch's iterator was ended early: {cancelled}")
    raise StopIteration


class EndOfIteration:
    """Queue marker: the iteration is over: every batch of every epoch of the iteration has been delivered."""


@dataclass(eq=False)
class EpochEnd:
    """Queue marker: every batch of ``epoch`` is in the queue, before this marker."""

    epoch: Epoch


class Job:
    """One task of an epoch (its plan's ``Work``), and the attempts now running it.

    A plain slotted class (one is made per batch, on the coordinator's hot path)."""

    __slots__ = ("attempts", "done", "epoch", "slot", "timeouts", "work")

    def __init__(self, epoch: Epoch, work: Work) -> None:
        self.epoch = epoch  # the epoch this job belongs to
        self.work = work
        self.attempts: list = []  # the engine's live Attempts of it (attempts.py)
        self.done = False  # an attempt replied; later replies are discarded
        self.timeouts = 0  # attempts killed after task_timeout
        self.slot = -1  # while waiting to be re-run: the slot of its last attempt (whose worker died)

    @property
    def seq(self) -> int:
        """The task's key in its epoch (an indexed source: the batch's position)."""
        return self.work.key

    @property
    def payload(self) -> Any:
        """What the worker reads: a list of indices, or a ``_sources.stream.Block`` (both iterate
        the keys of the samples they may hold, which messages about a lost task name)."""
        return self.work.payload

    @property
    def gen(self) -> int:
        return self.epoch.gen


class Epoch:
    """One pass over the data within an ``Iteration``, for any source kind: the engine's side of
    an ``EpochPlan`` (_sources/epoch_plan.py), which says which tasks the epoch holds and what their
    results become. This class keeps what is the same for every kind: the jobs sent and
    their ring slots, the counters, the skip budget, the tasks to run again, and handing
    the plan's batches to the iteration's queue.

    Threads: the coordinator thread dispatches (``offers``, ``take``), reports results
    (``result``) and losses (``lost``); with ``workers=0`` the inline driver (_consumer/inline.py)
    does the same in the consumer's thread. The consumer calls ``mark_consumed`` and reads
    ``consumer_progress`` / ``all_consumed`` (``Loader.state_dict``).
    """

    def __init__(self, gen: int, number: int, plan: EpochPlan, batches: Any, iteration: Iteration) -> None:
        self.gen = gen  # the iteration's id (unique per iteration), distinct from the epoch number
        self.number = number
        self.plan = plan
        self.batches = batches  # what the order gave: batches of indices, or a stream's shard order
        self.iteration = iteration
        self.counters = EpochCounters(epoch=number)
        self.jobs: dict[int, Job] = {}  # by key: sent, no result used yet
        self.redo: deque[Job] = deque()  # lost jobs (their worker died), given back to the plan at dispatch
        self.in_flight = 0  # jobs sent and not answered (those waiting to be re-run included)
        self.issued = 0  # distinct tasks dispatched
        self.consumed = 0  # batches the consumer took (written by the consumer thread)
        self.delivered = 0  # batches put in the iteration's queue
        self.finished = False
        self.skips: SkipBudget | None = None  # on_error="skip": set when the epoch opens
        self.on_drop: Callable[[int], None] | None = None  # returns the slot of a job that will not run
        self.held: list = []  # queue items waiting for earlier epochs (ordered streams)

    @property
    def ordered(self) -> bool:
        return self.plan.ordered

    @property
    def fresh(self) -> bool:
        """Tasks never dispatched may remain."""
        return not self.finished and not self.plan.exhausted

    def skip_budget(self, max_skipped: int | float) -> SkipBudget:
        """``on_error="skip"``'s budget for this epoch (the coordinator's, or ``workers=0``'s)."""
        total = self.plan.sample_total()  # (None: not known in advance; a fraction is of those seen so far)
        return SkipBudget(
            max_skipped, self.plan.samples_seen if total is None else total, self.counters, self.plan.skips_tasks
        )

    # ---- dispatch
    def offers(self, per_lane: int) -> Sequence[Offer]:
        """The plan's tasks that may go now, best first (lost jobs given back to it first)."""
        redo = self.redo
        while redo:
            job = redo.popleft()
            if not self.plan.lost(job.work):  # nothing left to do there (a iteration read past a shard's end)
                self._drop(job)
        return self.plan.offers(per_lane)

    def take(self, offer: Offer, worker: int) -> Job:
        """``offer`` is sent to worker ``worker``: its job (a retry keeps its job and slot)."""
        work = self.plan.take(offer, worker)
        if offer.retry is None:
            job = self.jobs[work.key] = Job(self, work)
            self.issued += 1
            self.in_flight += 1
            self.iteration.issued += 1
            return job
        self.counters.redispatched_tasks += 1
        return self.jobs[work.key]

    def moved(self, job: Job, worker: int) -> None:
        """``job`` was sent to ``worker`` as well (speculation): its lane goes there (``EpochPlan.moved``)."""
        self.plan.moved(job.work, worker)

    def lost(self, job: Job) -> None:
        """``job``'s worker died before it answered (its slot is in ``job.slot``): run it again."""
        self.redo.append(job)

    def _drop(self, job: Job) -> None:
        self.jobs.pop(job.seq, None)
        self.in_flight -= 1
        if job.slot >= 0 and self.on_drop is not None:
            self.on_drop(job.slot)
            job.slot = -1

    # ---- results
    def result(self, job: Job, result: Any) -> None:
        """``job``'s result: ``epoch_plan.Loaded`` (its batch), ``EMPTY`` (every sample skipped) or a
        ``Failure``; the batches the plan hands out for it go to the iteration's queue, in order."""
        if self.jobs.pop(job.work.key, None) is None or self.finished:
            return
        self.in_flight -= 1
        iteration, counters = self.iteration, self.counters
        for position, batch, samples in self.plan.completed(job.work, result):
            if self.finished:
                return
            if type(batch) is Failure:
                if not batch.batch_only:  # the epoch ends with it
                    iteration.fail_at(self, batch)
                    self.finish()
                    return
            elif batch is EMPTY:
                continue
            else:
                counters.batches += 1
                counters.samples += samples
            self.delivered += 1
            iteration.delivered += 1
            iteration.emit(self, (self, position, batch))
        if not self.finished and self.plan.complete:
            iteration.epoch_done(self)

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.plan.finish()
        for job in [*self.redo, *self.jobs.values()]:  # (a job waiting to be re-run holds its slot)
            if job.slot >= 0 and not job.attempts and self.on_drop is not None:
                self.on_drop(job.slot)
                job.slot = -1
        self.redo.clear()
        self.jobs.clear()  # (job -> epoch -> job: no cycle left to wait for the garbage collector)
        if self.counters.ended is None:
            self.counters.ended = time.perf_counter()

    # ---- the consumer's side (consumer thread): what it has had, for Loader.state_dict()
    def mark_consumed(self, seq: int) -> None:
        """The consumer took the batch at position ``seq``."""
        self.consumed += 1
        self.plan.taken(seq)

    def consumer_progress(self) -> Any:
        """What the consumer has had of this epoch, in the form a resume takes back (``done``)."""
        return self.plan.state()

    def all_consumed(self) -> bool:
        """The consumer has had every batch of this epoch."""
        return self.plan.all_taken()


class Iteration:
    """What one ``iter(loader)`` asked for: epochs ``start, start + 1, ...`` before ``until``
    (``None``: forever), as one continuous series of jobs.

    The coordinator opens the next epoch as soon as every batch of the open ones has been
    dispatched (``fresh``), so workers go on across the boundary instead of draining.
    Every epoch keeps its own reassembly, counters and progress; their batches go into
    one queue, ``out``, as ``(epoch, position, batch)`` tuples, each epoch followed by an
    ``EpochEnd`` marker and the iteration by ``EndOfIteration``. An ordered iteration holds a later
    epoch's items back until every earlier epoch is out (order by epoch, then position);
    a sloppy one does not. A ``Failure`` ends the iteration (in order, when ordered).

    Threads: the consumer creates the iteration and its first epoch (so that ``batches()``
    errors surface in ``iter()``), reads ``out`` and writes ``consumed`` and ``wait_s``;
    the rest is the coordinator thread's. ``opened`` maps an epoch number to its ``Epoch``
    for the consumer (``Loader.state_dict``), which removes the epochs it is past.
    """

    def __init__(
        self,
        gen: int,
        order: Any,
        start: int,
        until: int | None,
        ordered: bool,
        first_batches: list[list[int]],
        done: frozenset = frozenset(),
        ahead: dict[int, frozenset] | None = None,
        rotation: int = 0,
    ) -> None:
        self.gen = gen
        self.rotation = rotation  # assign="round_robin": batch k of an epoch to worker k % rotation
        self.order = order
        self.start = start
        self.until = until
        self.ordered = ordered
        self.ahead = dict(ahead or {})  # epoch -> positions already delivered (resume); popped when opened
        self.resumed_ahead = dict(self.ahead)  # the same, kept (resume_point)
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        # The coordinator's iteration: the items of a round wait here until ``publish``, which the
        # coordinator calls just before it sleeps (None: each item goes into ``out`` at once).
        self.pending: list | None = None
        self.epochs: deque[Epoch] = deque()  # open: not yet finished, or (ordered) not yet all out
        self.opened: dict[int, Epoch] = {}
        self.next_number = start + 1  # the next epoch to open
        self.finished = False
        self.issued = 0  # tasks dispatched, all epochs (coordinator thread)
        self.delivered = 0  # batches put in the queue, all epochs (coordinator thread)
        self.consumed = 0  # batches the consumer took (consumer thread)
        self.wait_s = 0.0  # seconds the consumer waited in next() (consumer thread; autotune reads it)
        self.on_open: Callable[[Epoch], None] | None = None  # the coordinator's per-epoch set-up
        self.last: Epoch | None = None  # the epoch opened last
        # The source kind's per-epoch plan, named by its order (_sources/epoch_plan.py Order.epoch_plan).
        self.epoch_plan: EpochPlanClass = order.epoch_plan
        self.first = self._epoch(start, first_batches, done)
        self.opened[start] = self.first

    def _epoch(self, number: int, batches: Any, done: Any) -> Epoch:
        plan = self.epoch_plan(self.order, number, batches, self.ordered, done)
        if self.rotation:
            plan.rotate(self.rotation)
        return Epoch(self.gen, number, plan, batches, self)

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
        if epoch.plan.complete:  # empty, or resumed at its end
            self.epoch_done(epoch)

    def outstanding(self) -> int:
        """Tasks in flight, results held back, and batches in the queue not taken yet: what the
        coordinator keeps under its ``max_outstanding``."""
        n = self.delivered - self.consumed
        for epoch in self.epochs:
            if not epoch.finished:
                n += epoch.in_flight + epoch.plan.held()
        return n

    def fresh(self) -> Epoch | None:
        """The first open epoch with batches never dispatched, opening the next epochs as needed."""
        for epoch in self.epochs:
            if epoch.fresh:
                return epoch
        while not self.finished and not self.exhausted:
            number = self.next_number
            self.next_number += 1
            try:
                batches = self.order.batches(number)
            except Exception as exc:  # noqa: BLE001 - the user's order can raise anything: it fails the epoch
                add_note(exc, f"procpipe: raised while computing the batches of epoch {number}")
                failed = self._epoch(number, [], None)
                self.epochs.append(failed)
                self.fail_at(failed, Failure(exc))
                return None
            if not batches and self.until is None:
                self.until = number  # an empty epoch would repeat forever: the iteration ends here
                self._maybe_end()
                return None
            epoch = self._epoch(number, batches, self.ahead.pop(number, None))
            self.open(epoch)
            if epoch.fresh:
                return epoch
        return None

    def resume_point(self, low: int) -> ResumePoint | None:
        """Where the consumer stands (consumer thread), to resume exactly there: ``(epoch, what it
        has had of it, {later epoch: what it has had of it}, until)``, each in the form of
        ``Epoch.consumer_progress()``; None once it has had everything. ``low``: the oldest
        epoch it is not past (the point is the oldest epoch from there not all returned)."""
        opened = dict(self.opened)  # a copy: the coordinator thread adds epochs

        def progress(n: int) -> tuple[Any, bool]:
            epoch = opened.get(n)
            if epoch is not None:
                return epoch.consumer_progress(), epoch.all_consumed()
            return self.epoch_plan.unopened_state(self.resumed_ahead.get(n)), False

        until = self.until
        done, complete = progress(low)
        # All of ``low`` returned, its end marker not read yet. Unordered, the epochs overlap: the
        # batch that completed it may have come after every batch of the next ones, so the point
        # is the first epoch not complete (the state names it, and ``loader.epoch`` resumes there).
        while complete:
            low += 1
            if until is not None and low >= until:
                return None
            done, complete = progress(low)
        ahead = {}
        for n in sorted(set(opened) | set(self.resumed_ahead)):
            if n > low:
                p, _ = progress(n)
                if p:
                    ahead[n] = p
        return ResumePoint(low, done, ahead, until)

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
        self._enqueue(item)
        if isinstance(item, Failure):
            self.finish()

    def _enqueue(self, item: Any) -> None:
        pending = self.pending
        if pending is None:
            self.out.put(item)
        else:
            pending.append(item)

    def publish(self) -> None:
        """Put the items held back (``pending``) into ``out``, in order (coordinator thread).

        The coordinator handles a round's replies and sends the next tasks before the consumer
        hears of the batches: woken while the coordinator still runs, the consumer would only
        wait for the GIL, and take it from the coordinator at its next system call (a task's
        send), one thread switch more per batch in each direction."""
        pending = self.pending
        if pending:
            put = self.out.put
            for item in pending:
                put(item)
            pending.clear()

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
            self._enqueue(EndOfIteration)

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
        """End the iteration now with ``exc`` (a worker error, a timeout, a broken engine)."""
        if not self.finished:
            self._put(Failure(exc))

    def finish(self) -> None:
        """Stop: the iteration ended, failed or was cancelled; replies still coming are discarded."""
        self.finished = True
        for epoch in self.epochs:
            epoch.finish()
            epoch.held.clear()  # (epoch -> held -> item -> epoch: a cycle holding ring slots)
        self.epochs.clear()

    def abandon(self) -> None:
        """The consumer is gone (cancel, a new iteration, close): stop, and drop what is queued.

        Queued items reference their epoch, which references this iteration, which holds the
        queue: a cycle that would keep those batches, and their ring slots, alive until the
        cyclic garbage collector runs. Dropping them returns the slots now. A reader still
        blocked on the queue (a device stage thread) gets ``EndOfIteration``.
        """
        self.finish()
        if self.pending:
            self.pending.clear()
        while True:
            try:
                self.out.get_nowait()
            except queue.Empty:
                break
        self.out.put(EndOfIteration)
