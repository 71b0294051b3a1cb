"""Epochs and streams: what the coordinator and the consumer share about an iteration's batches.

One ``iter(loader)`` is a ``Stream``: one epoch (the default), N epochs or endless
(``Loader(epochs=...)``). Each ``Epoch`` is a list of batches; each batch is a ``Job``, and
each time a job is sent to a worker is an ``Attempt`` (attempts.py: normally one; more when a
worker dies, straggles or times out, see coordinator.py). The coordinator thread takes jobs from
the stream, turns the replies into batches, and hands them to ``Epoch.deliver``, which
passes them through the epoch's reassembly (reassembly.py) into the stream's queue,
``out``, that the consumer's iterator reads (iterators.py). A streaming source with
``workers=0`` drives the same kind of stream in the consumer's thread
(streaming.InlineStream).

The stream opens the next epoch as soon as every batch of the open ones has been
dispatched, so workers keep working across the epoch boundary; each epoch keeps its own
reassembly, counters and progress, and all of them feed one queue, tagged with their
epoch. Besides batches, the queue carries markers: ``EpochEnd`` after each epoch,
``EndOfStream`` after the stream, and a ``Failure`` that ends it. A batch whose user code
raised is a ``Failure(..., batch_only=True)`` in its place: the consumer raises it and
the iteration goes on with the next batch (as torch's DataLoader does).
"""
from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from . import collate
from .reassembly import Ordered, Progress, ResumePoint, Sloppy
from .stats import EpochCounters

if TYPE_CHECKING:
    from .skips import SkipBudget


def iteration_over(cancelled: str | None) -> None:
    """What ``next()`` does on an epoch iterator that has ended: say why if it was ended early."""
    if cancelled:
        raise RuntimeError(f"this epoch's iterator was ended early: {cancelled}")
    raise StopIteration


class Dispatcher(Protocol):
    """What an epoch that dispatches its own jobs (``Epoch.pins_workers``: a streaming epoch,
    which sends each block to the worker reading its shard) may use of the engine. The
    coordinator is one; an epoch never reads more of it than this."""

    tasks_per_worker: int  # tasks a worker may hold at once
    max_outstanding: int  # batches dispatched and not yet consumed, at most
    workers: list  # the engine's WorkerLinks: ``index``, ``tasks``, ``usable``, ``retiring``

    def has_free_slot(self) -> bool:
        """A ring slot is free now (a block may go into the ring rather than the pipe)."""

    def take_slot(self, epoch: Epoch) -> int | None:
        """A free ring slot for a task of ``epoch`` (None: none)."""

    def send(self, worker: Any, job: Job, slot: int) -> None:
        """Send ``job`` to ``worker`` into ``slot`` (-1: inline)."""


class EndOfStream:
    """Queue marker: the iteration is over: every batch of every epoch of the stream has been delivered."""


@dataclass(eq=False)
class EpochEnd:
    """Queue marker: every batch of ``epoch`` is in the queue, before this marker."""

    epoch: Epoch


class EmptyBatch:
    """Reassembly item: a batch every sample of which was skipped (``on_error="skip"``)."""


@dataclass
class Failure:
    """Queue item: the epoch ends with this exception, raised in the consumer.

    ``batch_only``: only one batch failed (its user code raised); it is delivered in that
    batch's place, raised by ``next()``, and the next ``next()`` goes on with the batches
    after it. Otherwise (a dead engine, a broken sampler, a skip budget overrun) the
    iteration ends with it.
    """

    exc: BaseException
    batch_only: bool = False


@dataclass(eq=False)
class Job:
    """One batch of an epoch, and the attempts now running it."""

    epoch: Epoch  # the epoch this job belongs to
    seq: int  # position of the batch in the epoch
    indices: list[int]
    attempts: list = field(default_factory=list)  # the engine's live Attempts of it (attempts.py)
    done: bool = False  # an attempt replied; later replies are discarded
    timeouts: int = 0  # attempts killed after task_timeout
    slot: int = -1  # while waiting to be re-run: the slot of its last attempt (whose worker died)

    @property
    def gen(self) -> int:
        return self.epoch.gen


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
    skips_batches = True  # on_error="skip" may leave out a whole batch that failed (collation)

    def sample_total(self) -> int:
        """The epoch's samples (what a fractional ``max_skipped`` is a fraction of)."""
        return sum(map(len, self.batches))

    def ring_slot_bytes(self, layout: list, nbytes: int, job: Job, skipped: int) -> int | None:
        """Slot size for the ring, from the first batch to arrive (``job``'s, less ``skipped``
        samples left out, ``nbytes`` bytes laid out as ``layout``); None: this one cannot tell.

        A short batch (the epoch's last, or one with skipped samples) often arrives first;
        it must not size the slots, or every full batch after it would overflow: its size
        is scaled up to the epoch's largest batch, plus each array's alignment padding.
        """
        samples = len(job.indices) - skipped
        full = max(map(len, self.batches), default=samples)
        if samples <= 0 or samples >= full:
            return nbytes
        return -(-nbytes * full // samples) + collate.ALIGN * collate.count_arrays(layout)

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
            if isinstance(ready, Failure) and not ready.batch_only:
                self.stream.fail_at(self, ready)
                return
            if ready is EmptyBatch:
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
        self.reassembly.drop_waiting()  # batches that will never be delivered (cancelled, or behind a failure)
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
    ``EpochEnd`` marker and the stream by ``EndOfStream``. An ordered stream holds a later
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

    def resume_point(self, low: int) -> ResumePoint | None:
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
            self.out.put(EndOfStream)

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
        blocked on the queue (a device stage thread) gets ``EndOfStream``.
        """
        self.finish()
        while True:
            try:
                self.out.get_nowait()
            except queue.Empty:
                break
        self.out.put(EndOfStream)

