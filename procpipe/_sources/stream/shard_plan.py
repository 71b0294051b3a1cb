"""The plan of one epoch of a streaming source: ``ShardPlan`` (``_sources.epoch_plan.EpochPlan``'s contract).

Where it sits in the data path: the ``Iteration`` of an iteration (procpipe/_engine/epochs.py)
makes one per epoch, named by ``ShardOrder`` (shard_order.py) as its ``epoch_plan``; the
engine's ``Epoch`` drives it like any plan. It opens shards (at most ``cycle_length`` at
once), offers their ``Block`` tasks (shards.py), each in the lane of its shard so that
the worker reading the shard gets it; results are put in the interleave's order when
ordered (``Interleave``, interleave.py), turned into batches (``Output``, block_batching.py) and
handed out, each with the record ranges it covers, which are added to the epoch's
``StreamProgress`` as the consumer takes the batch (``taken``). With ``workers=0``
the Loader's inline driver (procpipe/_consumer/inline.py) drives the same plan in the consumer's thread.

Pure: it never sees a process, a ring slot or a worker, only a worker's index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

from ..._core.reassembly import Progress
from ..epoch_plan import EMPTY, EpochPlan, Failure, Loaded, Offer, Ready, Work
from .block_batching import Output
from .blocks import Block, split_block_layout
from .interleave import StreamProgress
from .stream_positions import StreamPositions

_NO_RECORDS: list[tuple[int, int, int]] = []  # the coverage of a batch not recorded (never modified)


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
    redo: list = field(default_factory=list)  # tasks to run again (their worker died), by block


class BlockWork(Work):
    """A block of one shard as a task (``payload`` is the ``Block``; ``lane`` the shard's position)."""

    __slots__ = ("block", "shard")

    def __init__(self, key: int, payload: Block, lane: int, *, shard: _Shard, block: int) -> None:
        super().__init__(key, payload, lane)
        self.shard = shard
        self.block = block


class ShardPlan(EpochPlan):
    """One epoch of a streaming source: an epoch whose length is discovered as its shards
    end. ``order`` is the shards' order (indices into ``Shards.shards``); ``config`` the
    ``ShardOrder`` (block length, cycle length, batching, the source: its ``shards``).

    Bounds: at most ``cycle_length`` shards open; a shard has at most ``per_lane`` blocks
    in flight; the engine keeps blocks in flight, blocks waiting for their turn and batches
    not yet taken under its ``max_outstanding``, except the block the ordered interleave
    waits for (an urgent offer), which always goes, so the order never deadlocks.

    Resume: ``resumed`` is the ``StreamProgress.state()`` of the epoch as it was saved (or
    None). The epoch then leaves out the complete shards, restarts the interleave at the
    saved cursor (ordered) or each shard at its first block not entirely received, and its
    blocks skip the records received (``Block.skip``). Each batch it hands out covers some
    records (``coverage``, by position), which are added to ``received`` when the consumer
    takes the batch: what ``Loader.state_dict()`` saves.
    """

    skips_tasks = False  # on_error="skip": a failed block cannot be left out (its shard cannot be read past it)
    positions = StreamPositions()

    def __init__(self, config: Any, number: int, order: list[int], ordered: bool, resumed: Any = None) -> None:
        resumed = resumed or None  # (a fresh epoch may be given an empty set of positions)
        self.config = config
        self.ordered = ordered
        self.block_length = config.block_length
        limits = getattr(config, "limits", None)  # even_ranks: where this rank's shards are cut (None: read whole)
        self.limits = None if limits is None else limits(number)
        self.resumed = resumed is not None
        self.received = StreamProgress(list(order), config.cycle_length, config.block_length, ordered, resumed)
        self.resume = StreamProgress(list(order), config.cycle_length, config.block_length, ordered, resumed)
        self.order = self.received.order  # the shards read, in the epoch's order (less those complete)
        self.coverage: dict[int, list] = {}  # by position: the records of each batch not yet taken
        self.ends: dict[int, int] = {}  # shard -> upper bound of its record count (StreamProgress)
        self.states: dict[int, _Shard] = {}  # by position: opened, not retired
        self.sent: dict[int, BlockWork] = {}  # by key: dispatched, no result used yet
        self.waiting: dict[tuple[int, int], tuple] = {}  # ordered: (position, block) -> (work, count, payload)
        self.next_key = 0
        self.opened = 0  # shards opened (positions 0 .. opened-1)
        self.ended = 0  # shards whose last block has arrived
        self.completed_shards = 0  # shards whose every block has been used
        self.handed_out = 0  # batches handed out (the next one's position)
        self.records_read = 0  # by the blocks whose results came (a fractional max_skipped's base)
        self.finished = False  # failed or finished: results still coming are ignored
        self.done = False  # every batch handed out
        self.progress = Progress()  # positions the consumer has taken (consumer thread)
        self.output = Output(config.batching, number)
        self._out: list[Ready] = []  # what the result being handled gives
        self.interleave = self.resume.cursor  # ordered: the coordinator's own copy
        if self.interleave is not None:
            self._resume_at_cursor()
        self.done = self.completed_shards >= len(self.order)

    def _resume_at_cursor(self) -> None:
        """Open the shards the interleave holds, each at its block; those it is past are complete."""
        interleave = self.interleave
        assert interleave is not None, "called when a resume left an interleave"
        self.opened = interleave.opened
        for slot in interleave.slots:
            if slot is not None:
                position, block = slot
                index = self.order[position]  # (a shard bound to a worker stays bound after a resume)
                self.states[position] = _Shard(
                    position, index, next_block=block, used=block, worker=self.config.shards.worker_for(index)
                )
        self.ended = self.completed_shards = self.opened - len(self.states)

    def sample_total(self) -> int | None:
        """The epoch's records, from ``Shards(lengths=...)``; None without them."""
        lengths = self.config.shards.lengths
        return None if lengths is None else sum(lengths[s] for s in self.order)

    def samples_seen(self) -> int:
        """Records read by the blocks whose results were used, plus a whole block: the one whose
        skipped records are being counted (they are counted before its result is used)."""
        return self.records_read + self.block_length

    # ------------------------------------------------------------------ dispatch
    @property
    def exhausted(self) -> bool:
        """No block never dispatched remains: every shard's end is known."""
        return self.finished or self.ended >= len(self.order)

    def offers(self, per_lane: int) -> list[Offer]:
        """One offer per open shard that may send a block: its block to run again first, then
        the block the ordered interleave waits for (urgent), then the others, those least
        ahead of the interleave (ordered) or with the fewest in flight first."""
        if self.finished:
            return []
        self._open_shards()
        head = self.interleave.awaited() if self.interleave is not None else None
        offers = []
        for state in self.states.values():
            if state.redo:
                offers.append(
                    Offer((0, state.redo[0].block, state.position), state.position, state.worker, retry=state.redo[0])
                )
            elif state.end is not None or state.in_flight >= per_lane:
                continue
            elif head == (state.position, state.next_block):
                offers.append(Offer((1, 0, 0), state.position, state.worker, urgent=True))
            else:
                ahead = state.next_block - state.used if self.ordered else state.in_flight
                offers.append(Offer((2, ahead, state.position), state.position, state.worker))
        offers.sort(key=_rank)
        return offers

    def take(self, offer: Offer, worker: int) -> BlockWork:
        lane = offer.lane
        assert lane is not None, "a shard plan's offers name their shard's lane"
        state = self.states[lane]
        state.worker = worker  # the shard's reader from now on (affinity)
        if offer.retry is not None:
            retry = cast(BlockWork, offer.retry)  # a retry offer carries the work this plan's take() made
            state.redo.remove(retry)
            return retry
        b, length = state.next_block, self.block_length
        state.next_block += 1
        key = self.next_key
        self.next_key += 1
        if self.limits is not None:  # even_ranks: a shard cut short ends at its cut
            length = self.limits.block_length_at(state.index, b * length, length)
        block = Block(state.index, b, b * self.block_length, length, self.resume.skips(state.index, b))
        work = self.sent[key] = BlockWork(key, block, state.position, shard=state, block=b)
        state.in_flight += 1
        return work

    def lost(self, work: Work) -> bool:
        """A block whose worker died: again on its shard's worker, before the shard's later blocks
        (False: the shard ended before it, so there is nothing to read)."""
        work = cast(BlockWork, work)  # the engine hands back the work this plan's take() made
        state = work.shard
        if state.end is not None and work.block > state.end:
            self.sent.pop(work.key, None)
            state.in_flight -= 1
            self._retire(state)
            return False
        state.redo.append(work)
        state.redo.sort(key=lambda w: w.block)
        return True

    def moved(self, work: Work, worker: int) -> None:
        """The shard's reader is now ``worker`` (a speculative attempt at one of its blocks):
        its later blocks follow, rather than waiting behind the straggler's stalled block."""
        cast(BlockWork, work).shard.worker = worker  # the work this plan's take() made

    def lanes_held(self) -> dict[int, int]:
        """Worker index -> shards it reads whose end is not known yet."""
        load: dict[int, int] = {}
        for state in self.states.values():
            if state.worker is not None and state.end is None:
                load[state.worker] = load.get(state.worker, 0) + 1
        return load

    def held(self) -> int:
        return len(self.waiting)

    def _open_shards(self) -> None:
        """Open shards as others end: at most ``cycle_length`` at once (tf.data's cycle).

        Ordered, a shard starts at its first block, as the interleave opens it; unordered,
        at its first block not entirely received before a resume.
        """
        while self.opened < len(self.order) and self.opened - self.ended < self.config.cycle_length:
            index = self.order[self.opened]
            state = self.states[self.opened] = _Shard(self.opened, index, worker=self.config.shards.worker_for(index))
            if self.interleave is None:
                state.next_block = state.got.below = self.resume.first_unreceived_block(state.index)
            self.opened += 1

    # ------------------------------------------------------------------ results
    def slot_bytes(self, work: Work, layout: list, nbytes: int, skipped: int) -> int | None:
        """Size the ring from the first block holding records: scaled up to a full block if it
        held fewer (a shard's short last block, or records skipped after a resume)."""
        kept = split_block_layout(layout)[0].kept
        if not kept:
            return None
        return math.ceil(nbytes * self.block_length / kept) if kept < self.block_length else nbytes

    def completed(self, work: Work, result: Any) -> list[Ready]:
        """A block's result: its records (``Loaded``), none (``EMPTY``) or its ``Failure``, which
        ends the epoch whatever it was (a shard cannot be read past a failed block)."""
        work = cast(BlockWork, work)  # the engine hands back the work this plan's take() made
        if self.sent.pop(work.key, None) is None or self.finished:
            return []
        if type(result) is Loaded:
            info, inner = split_block_layout(result.layout)
            records = work.payload.kept(info.read)
            if info.failed:  # on_error="skip" left these out
                records = [r for r in records if r not in info.failed]
            self._result(work, info.read, (records, inner, result.lease, info.failed))
        elif result is EMPTY:
            self._result(work, 0, None)
        else:
            self._result(work, None, Failure(result.exc))
        out, self._out = self._out, []
        return out

    @property
    def complete(self) -> bool:
        return self.done

    def _result(self, work: BlockWork, count: int | None, payload: Any) -> None:
        """``count`` records read; ``payload``: ``(records kept, layout, lease, records
        on_error="skip" left out)``, None if nothing was read, the block's Failure if ``count``
        is None."""
        state, b = work.shard, work.block
        state.in_flight -= 1
        self.records_read += count or 0
        if count is not None and count < self.block_length:
            self.ends[state.index] = min(self.ends.get(state.index, math.inf), b * self.block_length + count)
            self._learn_end(state, b)
        if state.end is not None and b > state.end:  # read past the shard's end: nothing there
            self._retire(state)
            return
        if self.ordered:
            self.waiting[(state.position, b)] = (work, count, payload)
            self._release_ordered()
        else:
            if count is None:
                self._fail(payload)
                return
            state.got.add(b)
            if payload is not None:
                self._emit(work, payload)
            if state.end is not None and state.got.below > state.end:
                self._complete(state)
            self._retire(state)
        if not self.finished and self.completed_shards == len(self.order):
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
        assert interleave is not None, "ordered epochs keep an interleave"
        while not self.finished:
            key = interleave.awaited()
            if key is None:
                return
            entry = self.waiting.pop(key, None)
            if entry is None:
                return
            work, count, payload = entry
            if count is None:
                self._fail(payload)
                return
            interleave.advance(count)
            state = work.shard
            state.used = key[1] + 1
            if payload is not None:
                self._emit(work, payload)
            if count < self.block_length:
                self._complete(state)
            self._retire(state)

    def _complete(self, state: _Shard) -> None:
        if not state.complete:
            state.complete = True
            self.completed_shards += 1

    def _retire(self, state: _Shard) -> None:
        if state.complete and not state.in_flight and not state.redo:
            self.states.pop(state.position, None)

    # ------------------------------------------------------------------ output
    def _emit(self, work: BlockWork, payload: tuple) -> None:
        records, inner, lease, failed = payload
        if failed:
            self.output.left_out(work.payload.shard, failed)
        if not records:
            return
        try:
            items = self.output.add(work.payload, records, inner, lease)
        except Exception as exc:  # noqa: BLE001 - the user's batching (collate_fn, shuffle) can raise anything: it ends the epoch
            self._fail(Failure(exc))
            return
        self._put(items)

    def _put(self, items: list[tuple[Any, int, list]]) -> None:
        for item, records, coverage in items:
            position = self.handed_out
            self.handed_out += 1
            self.coverage[position] = coverage
            self._out.append(Ready(position, item, records))

    def _end(self) -> None:
        try:
            items = self.output.flush()
        except Exception as exc:  # noqa: BLE001 - the user's collate_fn can raise anything: it ends the epoch
            self._fail(Failure(exc))
            return
        self._put(items)
        self.done = True

    def _fail(self, failure: Failure) -> None:
        """The epoch ends with ``failure`` (handed out after the batches before it)."""
        if not self.finished:
            self._out.append(Ready(-1, Failure(failure.exc)))
            self.finish()

    def finish(self) -> None:
        self.finished = True
        for state in self.states.values():
            state.redo.clear()
        self.waiting.clear()  # drops the leases of blocks that were waiting: their slots return
        self.output.clear()
        self.sent.clear()  # (work -> shard state -> work: no cycle left to wait for the garbage collector)
        self.states.clear()

    # ------------------------------------------------------------------ the consumer's side (resume)
    def taken(self, position: int) -> None:
        self.progress.add(position)
        self.received.add(self.coverage.pop(position, _NO_RECORDS), self.ends)

    def state(self) -> dict | None:
        """What the consumer has received of this epoch, as ``StreamProgress.state()``; None: nothing."""
        if not self.resumed and not len(self.progress):
            return None
        self.received.settle(self.ends)
        return self.received.state()

    def all_taken(self) -> bool:
        return self.done and len(self.progress) >= self.handed_out

    @classmethod
    def unopened_state(cls, resumed: Any) -> dict | None:
        return resumed or None


def _rank(offer: Offer) -> tuple:
    return offer.rank
