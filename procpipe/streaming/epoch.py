"""One epoch of a streaming source as the coordinator drives it: ``StreamEpoch``, ``BlockJob``.

Where it sits in the data path: the ``Stream`` of an iteration (procpipe/epochs.py)
builds its epochs from ``StreamPlan`` (plan.py), which names ``StreamEpoch`` as their
class. In the coordinator thread, ``StreamEpoch.dispatch`` opens shards (at most
``cycle_length`` at once), cuts them into ``Block`` tasks (shards.py) and sends each to
the worker reading its shard; replies come back through ``accept``/``deliver``, are put
in the interleave's order when ordered (``Interleave``, order.py), turned into batches
(``Output``, batching.py) and emitted into the stream's queue, each with the record
ranges it covers, which the consumer adds to the epoch's ``StreamProgress`` as it takes
the batch (``mark_consumed``). With ``workers=0`` ``InlineStream`` (plan.py) drives the
same epoch in the consumer's thread (``inline_job``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..epochs import Dispatcher, EmptyBatch, Epoch, Failure, Job
from ..skips import SkipBudget
from ..reassembly import Progress
from .batching import Output
from .order import StreamProgress
from .shards import Block, split_block_layout


@dataclass(eq=False)
class _Shard:
    """One shard of the epoch, from when it is opened until its last block is used."""

    position: int  # in the epoch's order
    index: int  # in Shards.shards
    worker: int | None = None  # index of the worker reading it (affinity)
    next_block: int = 0  # the next block never dispatched
    in_flight: int = 0  # blocks dispatched, not replied
    used: int = 0  # ordered: blocks the interleave has passed
    got: Progress = field(default_factory=Progress)  # sloppy: blocks received
    end: int | None = None  # its last block, once known
    complete: bool = False  # every block up to ``end`` has been used
    redo: list = field(default_factory=list)  # jobs to run again (their worker died), by block


@dataclass(eq=False)
class BlockJob(Job):
    """A block of one shard as a ``Job`` (procpipe/epochs.py; ``indices`` is the ``Block``)."""

    shard: _Shard | None = None
    block: int = 0


class StreamEpoch(Epoch):
    """One epoch of a streaming source within a ``Stream``: an ``Epoch`` whose length is
    discovered as its shards end. Its ``batches`` are the shards' order (indices into
    ``Shards.shards``); the stream's ``sampler`` is the ``StreamPlan``.

    Runs in the coordinator thread (``dispatch`` from ``Coordinator._dispatch``; ``accept``
    and ``deliver`` with each reply), or in the consumer's thread with ``workers=0``
    (``InlineStream``). What it delivers goes to the stream as ``(epoch, position,
    batch)``, positions counting the batches it yields. Bounds: at most ``cycle_length``
    shards open; blocks in flight, blocks waiting for their turn and batches not yet
    taken by the consumer stay under the coordinator's ``max_outstanding``, except the
    block the ordered interleave waits for, which always goes (through the pipe if no
    ring slot is free), so the order never deadlocks.

    Resume: ``done`` is the ``StreamProgress.state()`` of the epoch as it was saved (or
    empty). The epoch then leaves out the complete shards, restarts the interleave at the
    saved cursor (ordered) or each shard at its first block not entirely received, and its
    blocks skip the records received (``Block.skip``). Each batch it delivers carries its
    coverage (``coverage``, by position), which the consumer adds to ``taken`` when it
    takes the batch (``mark_consumed``): what ``Loader.state_dict()`` saves.
    """

    pins_workers = True  # the coordinator lets ``dispatch`` choose each block's worker
    skips_batches = False  # on_error="skip": a failed block cannot be left out (its shard cannot be read past it)

    def sample_total(self) -> int:
        """The epoch's records, from ``Shards(lengths=...)`` (``StreamPlan`` refuses a fractional
        ``max_skipped`` without them, so this is only asked with them)."""
        lengths = self.plan.source.lengths
        return 0 if lengths is None else sum(lengths[s] for s in self.batches)

    def skip_budget(self, max_skipped: int | float) -> SkipBudget:
        """``on_error="skip"`` with ``workers=0`` (the coordinator makes its own with workers)."""
        return SkipBudget(max_skipped, self.sample_total(), self.counters, self.skips_batches)

    def __post_init__(self, *args: Any) -> None:
        resume, self.done = self.done or None, frozenset()  # a StreamProgress state, not batch positions
        super().__post_init__(*args)  # counters, progress (its per-batch reassembly goes unused here)
        plan = self.stream.sampler
        self.plan = plan
        self.block_length = plan.block_length
        self.resumed = resume is not None
        self.taken = StreamProgress(list(self.batches), plan.cycle_length, plan.block_length, self.ordered, resume)
        self.resume = StreamProgress(list(self.batches), plan.cycle_length, plan.block_length, self.ordered, resume)
        self.order = self.taken.order  # the shards read, in the epoch's order (less those complete)
        self.coverage: dict[int, list] = {}  # by position: the records of each batch not yet taken
        self.ends: dict[int, int] = {}  # shard -> upper bound of its record count (StreamProgress)
        self.states: dict[int, _Shard] = {}  # by position: opened, not retired
        self.jobs: dict[int, BlockJob] = {}  # by seq: dispatched, no reply used yet
        self.waiting: dict[tuple[int, int], tuple] = {}  # ordered: (position, block) -> (job, count, payload)
        self.opened = 0  # shards opened (positions 0 .. opened-1)
        self.ended = 0  # shards whose last block has arrived
        self.completed = 0  # shards whose every block has been used
        self.in_flight = 0
        self.output = Output(plan.batching, self.number)
        self.interleave = self.resume.cursor  # ordered: the coordinator's own copy
        if self.interleave is not None:
            self._resume_at_cursor()
        self.remaining = math.inf if self.completed < len(self.order) else 0  # batches: unknown until the end

    def _resume_at_cursor(self) -> None:
        """Open the shards the interleave holds, each at its block; those it is past are complete."""
        self.opened = self.interleave.opened
        for slot in self.interleave.slots:
            if slot is not None:
                position, block = slot
                self.states[position] = _Shard(position, self.order[position], next_block=block, used=block)
        self.ended = self.completed = self.opened - len(self.states)

    @property
    def fresh(self) -> bool:
        """Blocks never dispatched may remain: some shard's end is not known yet."""
        return not self.finished and self.ended < len(self.order)

    @property
    def has_work(self) -> bool:
        return self.fresh or bool(self.redo)

    def new_job(self) -> Job:
        raise TypeError("a streaming epoch dispatches its own blocks (StreamEpoch.dispatch)")

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, co: Dispatcher) -> bool:
        """Send every block that can go now; True if it stopped for want of a slot or of consumption.

        ``co`` is the engine's side of dispatching (``epochs.Dispatcher``: the coordinator):
        its workers, its bounds, and its ``take_slot`` and ``send``.
        """
        if self.finished:
            return False
        while self.redo:  # the coordinator queues the jobs of a dead worker here
            self._requeue(self.redo.popleft())
        self._open_shards()
        head = self.interleave.awaited() if self.interleave is not None else None
        starved = False
        stream_epochs = [e for e in self.stream.epochs if isinstance(e, StreamEpoch)] or [self]
        while not self.finished:
            outstanding = sum(e.delivered - e.consumed + (0 if e.finished else e.in_flight + len(e.waiting))
                              for e in stream_epochs)
            no_slot = not co.has_free_slot()
            best = best_key = None
            for state in self.states.values():
                if state.redo:
                    key = (0, state.redo[0].block, state.position)  # has its slot
                elif state.end is not None or state.in_flight >= co.tasks_per_worker:
                    continue
                elif head == (state.position, state.next_block):
                    key = (1, 0, 0)
                elif outstanding >= co.max_outstanding:
                    starved = True
                    continue
                else:
                    ahead = state.next_block - state.used if self.ordered else state.in_flight
                    key = (2, ahead, state.position)
                if best_key is None or key < best_key:
                    worker = self._worker(state, co)
                    if worker is None or len(worker.tasks) >= co.tasks_per_worker:
                        continue
                    if no_slot and key[0] == 2 and worker.tasks:
                        starved = True  # it waits for a slot (a busy worker has work meanwhile)
                        continue
                    best, best_key = (state, worker), key
            if best is None:
                return starved
            state, worker = best
            if state.redo:
                job = state.redo.pop(0)
                slot, job.slot = job.slot, -1
                self.counters.redispatched_tasks += 1
            else:
                # No free slot (before the first block sizes the ring, or the consumer holds them
                # all): through the pipe, for the block the order waits for or an idle worker.
                slot = co.take_slot(self)
                if slot is None:
                    slot = -1
                job = self._new_job(state)
                state.in_flight += 1
                self.in_flight += 1
            co.send(worker, job, slot)
        return False

    def _requeue(self, job: BlockJob) -> None:
        """A job whose worker died: again on its shard's worker, before the shard's later blocks."""
        state = job.shard
        if job.done or (state.end is not None and job.block > state.end):  # nothing left to read there
            self.jobs.pop(job.seq, None)
            if job.slot >= 0 and self.on_drop is not None:
                self.on_drop(job.slot)
            state.in_flight -= 1
            self.in_flight -= 1
            self._retire(state)
            return
        state.redo.append(job)
        state.redo.sort(key=lambda j: j.block)

    def _open_shards(self) -> None:
        """Open shards as others end: at most ``cycle_length`` at once (tf.data's cycle).

        Ordered, a shard starts at its first block, as the interleave opens it; unordered,
        at its first block not entirely received before a resume.
        """
        while self.opened < len(self.order) and self.opened - self.ended < self.plan.cycle_length:
            index = self.order[self.opened]
            state = self.states[self.opened] = _Shard(self.opened, index, worker=self.plan.source.worker_for(index))
            if self.interleave is None:
                state.next_block = state.got.below = self.resume.first_unreceived_block(state.index)
            self.opened += 1

    def _new_job(self, state: _Shard) -> BlockJob:
        b, length = state.next_block, self.block_length
        state.next_block += 1
        seq = self.next_seq
        self.next_seq += 1
        self.issued += 1
        self.stream.issued += 1
        block = Block(state.index, b, b * length, length, self.resume.skips(state.index, b))
        job = BlockJob(self, seq, block, shard=state, block=b)
        self.jobs[seq] = job
        return job

    def _worker(self, state: _Shard, co: Dispatcher) -> Any:
        """The worker reading ``state``'s shard (assigned on first use: the one with the fewest open shards)."""
        workers = co.workers
        if state.worker is not None:
            for w in workers:
                if w.index == state.worker:
                    if w.retiring:
                        break  # autotune is retiring it: the shard moves
                    return w if w.usable else None
        # First block, or its worker is gone: the least loaded worker takes the shard (if it is
        # not the shard's first block, that worker opens the shard again and skips ahead).
        load = {w.index: 0 for w in workers}
        for other in self.states.values():
            if other.worker in load and other.end is None:
                load[other.worker] += 1
        usable = [w for w in workers if w.usable]
        if not usable:
            return None
        chosen = min(usable, key=lambda w: (load[w.index], len(w.tasks), w.index))
        state.worker = chosen.index
        return chosen

    # ------------------------------------------------------------------ replies
    def ring_slot_bytes(self, layout: list, nbytes: int, job: Any, skipped: int) -> int | None:
        """Size the ring from the first block holding records: scaled up to a full block if it
        held fewer (a shard's short last block, or records skipped after a resume)."""
        kept = split_block_layout(layout)[0].kept
        if not kept:
            return None
        return math.ceil(nbytes * self.block_length / kept) if kept < self.block_length else nbytes

    def accept(self, job: BlockJob, layout: list, lease: Any, skipped: int) -> None:
        """A block's records arrived (``lease``: its ring slot, or None when inline)."""
        if self.jobs.pop(job.seq, None) is None or self.finished:
            return
        info, inner = split_block_layout(layout)
        read, failed = info.read, info.failed
        records = job.indices.kept(read)
        if failed:  # on_error="skip" left these out
            records = [r for r in records if r not in failed]
        self._result(job, read, (records, inner, lease, failed))

    def deliver(self, seq: int, item: Any) -> None:
        """A block with no record (``EmptyBatch``), or a failed one (``Failure``)."""
        job = self.jobs.pop(seq, None)
        if job is None or self.finished:
            return
        if item is EmptyBatch:
            self._result(job, 0, None)
        else:
            self._result(job, None, item)

    def _result(self, job: BlockJob, count: int | None, payload: Any) -> None:
        """``count`` records read; ``payload``: ``(records kept, layout, lease, records
        on_error="skip" left out)``, None if
        nothing was read, the block's Failure if ``count`` is None."""
        state, b = job.shard, job.block
        state.in_flight -= 1
        self.in_flight -= 1
        if count is not None and count < self.block_length:
            self.ends[state.index] = min(self.ends.get(state.index, math.inf), b * self.block_length + count)
            self._learn_end(state, b)
        if state.end is not None and b > state.end:  # read past the shard's end: nothing there
            self._retire(state)
            return
        if self.ordered:
            self.waiting[(state.position, b)] = (job, count, payload)
            self._release_ordered()
        else:
            if count is None:
                self._fail(payload)
                return
            state.got.add(b)
            if payload is not None:
                self._emit(job, payload)
            if state.end is not None and state.got.below > state.end:
                self._complete(state)
            self._retire(state)
        if not self.finished and self.completed == len(self.order):
            self._end()

    def _learn_end(self, state: _Shard, block: int) -> None:
        if state.end is None:
            state.end = block
            self.ended += 1
            self._open_shards()
        elif block < state.end:
            state.end = block
        for key in [k for k in self.waiting if k[0] == state.position and k[1] > state.end]:
            del self.waiting[key]  # (blocks read past the end; their slots return to the ring)

    def _release_ordered(self) -> None:
        """Use the blocks the interleave waits for, in its order, as long as they are here."""
        interleave = self.interleave
        while not self.finished:
            key = interleave.awaited()
            if key is None:
                return
            entry = self.waiting.pop(key, None)
            if entry is None:
                return
            job, count, payload = entry
            if count is None:
                self._fail(payload)
                return
            interleave.advance(count)
            state = job.shard
            state.used = key[1] + 1
            if payload is not None:
                self._emit(job, payload)
            if count < self.block_length:
                self._complete(state)
            self._retire(state)

    def _complete(self, state: _Shard) -> None:
        if not state.complete:
            state.complete = True
            self.completed += 1

    def _retire(self, state: _Shard) -> None:
        if state.complete and not state.in_flight and not state.redo:
            self.states.pop(state.position, None)

    # ------------------------------------------------------------------ output
    def _emit(self, job: BlockJob, payload: tuple) -> None:
        records, inner, lease, failed = payload
        if failed:
            self.output.left_out(job.indices.shard, failed)
        if not records:
            return
        try:
            items = self.output.add(job.indices, records, inner, lease)
        except Exception as exc:
            self._fail(Failure(exc))
            return
        self._put(items)

    def _put(self, items: list[tuple[Any, int, list]]) -> None:
        counters = self.counters
        for item, records, coverage in items:
            seq = self.delivered
            self.delivered += 1
            counters.batches += 1
            counters.samples += records
            self.coverage[seq] = coverage
            self.stream.emit(self, (self, seq, item))
            if self.finished:
                return

    def _end(self) -> None:
        try:
            items = self.output.flush()
        except Exception as exc:
            self._fail(Failure(exc))
            return
        self._put(items)
        if not self.finished:
            self.remaining = self.delivered
            self.stream.epoch_done(self)

    def _fail(self, failure: Failure) -> None:
        if not self.finished:
            self.stream.fail_at(self, failure)
            self.finish()

    def finish(self) -> None:
        super().finish()
        for state in self.states.values():
            for job in state.redo:
                if job.slot >= 0 and self.on_drop is not None:
                    self.on_drop(job.slot)
            state.redo.clear()
        self.waiting.clear()  # drops the leases of blocks that were waiting: their slots return
        self.output.clear()
        self.jobs.clear()  # (job -> epoch -> job: no cycle left to wait for the garbage collector)
        self.states.clear()

    # ------------------------------------------------------------------ the consumer's side (resume)
    def mark_consumed(self, seq: int) -> None:
        super().mark_consumed(seq)
        self.taken.add(self.coverage.pop(seq, ()), self.ends)

    def consumer_progress(self) -> dict | None:
        """What the consumer has received of this epoch, as ``StreamProgress.state()``; None: nothing."""
        if not self.resumed and not len(self.progress):
            return None
        self.taken.settle(self.ends)
        return self.taken.state()

    def all_consumed(self) -> bool:
        return len(self.progress) >= self.remaining

    @classmethod
    def unopened_progress(cls, resumed: Any) -> dict | None:
        return resumed or None

    # ------------------------------------------------------------------ workers=0
    def inline_job(self) -> BlockJob:
        """The block the interleave waits for, as a job to run in this process (``workers=0``)."""
        self._open_shards()
        position, _ = self.interleave.awaited()
        state = self.states[position]
        job = self._new_job(state)
        state.in_flight += 1
        self.in_flight += 1
        return job
