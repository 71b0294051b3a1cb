"""An epoch's order (``Interleave``) and how far the consumer got in it (``StreamProgress``).

Where it sits in the data path: ``Interleave`` is tf.data's deterministic interleave; an
ordered ``ShardPlan`` (shard_plan.py) keeps one in the coordinator thread and releases the
blocks that arrive in its order. ``StreamProgress`` is kept in the consumer's thread,
from the record ranges of each batch the consumer takes: what ``Loader.state_dict()``
saves for the epoch and a resumed epoch skips (its cursor is an ``Interleave``, so a
resumed ordered epoch restarts the order where it stood). Both are plain bookkeeping,
with no process, ring slot or queue in them.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from ..saved_state import SHARD, STREAM

_PENDING_SPANS = 16384  # record ranges the consumer's StreamProgress gathers before it merges them
_SHARD_SHIFT = 40  # merging ranges, record r of shard s is at (s << 40) + r (shards of up to 2**40 records)


class Interleave:
    """tf.data's deterministic interleave, one block at a time, as block lengths become known.

    ``cycle_length`` positions each hold an open shard. Turns go round the positions in
    order; a turn takes the next block (up to ``block_length`` records) of the position's
    shard. A block with fewer records (possibly none: a shard of exactly k blocks has an
    empty k+1-th) ends the shard and empties the position; the next turn at an empty
    position opens the next shard there and takes its first block; an empty position
    with no shard left is passed over. This is exactly the record order of
    ``tf.data.Dataset.interleave(cycle_length=C, block_length=B)`` over the same shards.
    """

    def __init__(self, shards: int, cycle_length: int, block_length: int) -> None:
        self.shards = shards
        self.block_length = block_length
        self.slots: list[list[int] | None] = [None] * max(1, min(cycle_length, shards))  # [position, block]
        self.turn = 0
        self.opened = 0

    def awaited(self) -> tuple[int, int] | None:
        """``(shard position, block)`` of the current turn, or None once every shard has ended."""
        slots = self.slots
        for _ in range(len(slots)):
            slot = slots[self.turn]
            if slot is None and self.opened < self.shards:
                slot = slots[self.turn] = [self.opened, 0]
                self.opened += 1
            if slot is not None:
                return slot[0], slot[1]
            self.turn = (self.turn + 1) % len(slots)
        return None

    def advance(self, count: int) -> None:
        """The awaited block held ``count`` records: on to the next turn."""
        slot = cast("list[int]", self.slots[self.turn])  # (the awaited slot: not None)
        slot[1] += 1
        if count < self.block_length:
            self.slots[self.turn] = None
        self.turn = (self.turn + 1) % len(self.slots)

    def state(self) -> list:
        """``[turn, opened, slots]``, plain lists: where it stands (a resume state's ``cursor``)."""
        return [self.turn, self.opened, [None if slot is None else list(slot) for slot in self.slots]]

    @classmethod
    def restored(cls, shards: int, cycle_length: int, block_length: int, state: list | None) -> Interleave:
        """An interleave standing where ``state`` (from ``state()``) says; at the start if None."""
        interleave = cls(shards, cycle_length, block_length)
        if state is not None:
            interleave.turn, interleave.opened = state[0], state[1]
            interleave.slots = [None if slot is None else list(slot) for slot in state[2]]
        return interleave


# ---------------------------------------------------------------------- what the consumer has received
class StreamProgress:
    """The records of one epoch of a stream the consumer has received: what a resume skips.

    Kept in the consumer's thread, from the coverage of each batch it takes (the records
    in it, plus those ``drop_last`` left out just before it), so it never counts what the
    workers ran ahead with. Its ``state()`` is the epoch's part of ``Loader.state_dict()``,
    a plain dict:

    - ``complete``: shards (indices into ``Shards.shards``) entirely received; a resumed
      epoch leaves them out of its order.
    - ``cursor`` (an ordered epoch; ``None`` otherwise): ``[turn, opened, slots]`` of the
      ``Interleave`` over the epoch's other shards, standing at the first block not
      entirely received. Every block before it was received; the slots say which shards
      are open, at which block. A resumed ordered epoch restarts the interleave there, so
      what follows is what the uninterrupted epoch would have given.
    - ``received``: ``[shard, start, stop]`` record ranges received beyond that (every one,
      without a cursor), sorted and merged. A resumed epoch's blocks skip them.

    An ordered epoch resumed from a state without cursor (saved with ``ordered=False``)
    starts a new interleave over the shards not complete; an unordered one resumed from a
    state with a cursor turns the blocks behind the cursor into ``complete``/``received``.
    Shard ends (``ends``: shard -> an upper bound of its record count, exact once every
    record below it is received) come from the epoch, which learns them as blocks arrive.
    """

    def __init__(
        self, order: list[int], cycle_length: int, block_length: int, ordered: bool, state: dict | None = None
    ) -> None:
        self.block_length = block_length
        state = state or {"cursor": None, "complete": [], "received": []}
        self.complete = set(state["complete"])
        self.order = [shard for shard in order if shard not in self.complete]  # what the epoch reads
        self.received: dict[int, _Ranges] = {}
        self.pending: list[tuple[int, int, int]] = [tuple(entry) for entry in state["received"]]
        self._merge_pending()
        cursor = state["cursor"]
        if ordered:
            self.cursor: Interleave | None = Interleave.restored(len(self.order), cycle_length, block_length, cursor)
            self.settle({})  # (from a state without cursor: past the blocks entirely received)
        else:
            self.cursor = None
            if cursor is not None:
                self._unfold(Interleave.restored(len(self.order), cycle_length, block_length, cursor))
                self.order = [shard for shard in self.order if shard not in self.complete]

    def add(self, coverage: list[tuple[int, int, int]], ends: dict[int, int]) -> None:
        """The consumer took a batch covering these ``(shard, start, stop)`` record ranges.

        They are gathered and merged in bulk: a shuffle buffer's batches hold scattered
        records, which come together over a few batches.
        """
        self.pending += coverage
        if len(self.pending) >= _PENDING_SPANS:
            self.settle(ends)

    def settle(self, ends: dict[int, int]) -> None:
        """Take in the ranges gathered, then move the cursor past the blocks entirely received
        (ordered), or mark shards complete."""
        self._merge_pending()
        if self.cursor is not None:
            self._advance(self.cursor, ends)
            return
        for shard in [s for s, ranges in self.received.items() if ranges.starts[0] == 0]:
            end = ends.get(shard)
            if end is not None and self.received[shard].stops[0] >= end:
                self.complete.add(shard)
                del self.received[shard]

    def state(self) -> dict:
        """The plain-dict form (see the class docstring), canonical: the same progress gives an
        equal dict. Call ``settle`` first."""
        return {
            "cursor": None if self.cursor is None else self.cursor.state(),
            "complete": sorted(self.complete),
            "received": [
                [shard, start, stop]
                for shard in sorted(self.received)
                for start, stop in zip(self.received[shard].starts, self.received[shard].stops, strict=True)
            ],
        }

    def skips(self, shard: int, block: int) -> tuple[tuple[int, int], ...]:
        """The ranges of records of ``block`` of ``shard`` already received (a ``Block``'s ``skip``)."""
        ranges = self.received.get(shard)
        return () if ranges is None else ranges.within(block * self.block_length, (block + 1) * self.block_length)

    def first_unreceived_block(self, shard: int) -> int:
        """The first block of ``shard`` not entirely received (where an unordered resume starts it)."""
        ranges = self.received.get(shard)
        return ranges.stops[0] // self.block_length if ranges is not None and ranges.starts[0] == 0 else 0

    def _merge_pending(self) -> None:
        """Merge the gathered ranges into ``received`` in one vectorized pass: every shard's
        ranges, old and new, laid end to end on one line (record ``r`` of shard ``s`` at
        ``(s << _SHARD_SHIFT) + r``), sorted, and joined where they overlap or touch. (A
        shuffle buffer's batches add thousands of scattered one-record ranges: merging them
        one by one in Python cost the consumer more than the rest of ``next()``.)"""
        if not self.pending:
            return
        spans = np.fromiter(itertools.chain.from_iterable(self.pending), np.int64, 3 * len(self.pending)).reshape(-1, 3)
        self.pending = []
        offsets = spans[:, 0] << _SHARD_SHIFT
        start_parts, stop_parts = [spans[:, 1] + offsets], [spans[:, 2] + offsets]
        for shard, ranges in self.received.items():
            start_parts.append(np.array(ranges.starts, np.int64) + (shard << _SHARD_SHIFT))
            stop_parts.append(np.array(ranges.stops, np.int64) + (shard << _SHARD_SHIFT))
        starts, stops = np.concatenate(start_parts), np.concatenate(stop_parts)
        order = np.argsort(starts, kind="stable")
        starts, stops = starts[order], stops[order]
        reach = np.maximum.accumulate(stops)
        first = np.flatnonzero(np.concatenate(([True], starts[1:] > reach[:-1])))
        last = np.append(first[1:], len(starts)) - 1
        starts, stops = starts[first], reach[last]
        shards = starts >> _SHARD_SHIFT
        cuts = np.flatnonzero(np.diff(shards)) + 1
        self.received = {}
        for shard_starts, shard_stops in zip(np.split(starts, cuts), np.split(stops, cuts), strict=True):
            offset = int(shard_starts[0] >> _SHARD_SHIFT) << _SHARD_SHIFT
            self.received[offset >> _SHARD_SHIFT] = _Ranges(
                (shard_starts - offset).tolist(), (shard_stops - offset).tolist()
            )

    def _advance(self, cursor: Interleave, ends: dict[int, int]) -> None:
        length = self.block_length
        while (key := cursor.awaited()) is not None:
            position, block = key
            shard = self.order[position]
            count = self._received_block(shard, block, ends.get(shard))
            if count is None:
                return
            cursor.advance(count)
            ranges = self.received.get(shard)
            if ranges is not None and (count < length or not ranges.drop_below((block + 1) * length)):
                del self.received[shard]  # (count < length: the shard's last block, nothing more to know)

    def _received_block(self, shard: int, block: int, end: int | None) -> int | None:
        """The record count of ``block`` of ``shard`` if all its records were received, else None."""
        start = block * self.block_length
        stop = start + self.block_length if end is None else min(start + self.block_length, end)
        if stop <= start:
            return 0
        ranges = self.received.get(shard)
        return stop - start if ranges is not None and ranges.covers(start, stop) else None

    def _unfold(self, cursor: Interleave) -> None:
        """A cursor's meaning without it: shards it is past are complete; open ones received up to their block."""
        open_positions = {slot[0]: slot[1] for slot in cursor.slots if slot is not None}
        for position in range(cursor.opened):
            shard = self.order[position]
            if position not in open_positions:
                self.complete.add(shard)
                self.received.pop(shard, None)
            elif open_positions[position]:
                self.received.setdefault(shard, _Ranges()).add(0, open_positions[position] * self.block_length)


def merged_progress(
    entries: list[dict[str, Any]], order_of: Callable[[int, int], list[int]], settings: dict[str, Any]
) -> dict[str, Any]:
    """Every rank's progress (``combine.py``'s ``_stream_entries``) in shard terms (no cursor), merged;
    ``order_of(rank, world)``: the shards of that rank's order in the epoch."""
    complete: set[int] = set()
    received: list[list[int]] = []
    for entry in entries:
        order = order_of(*entry[SHARD])
        if entry["past"]:
            complete.update(order)  # past the epoch: every shard of it read
            continue
        if entry[STREAM] is None:
            continue
        progress = StreamProgress(
            order, settings["cycle_length"], settings["block_length"], False, entry[STREAM]
        ).state()  # (a cursor unfolded into complete / received)
        complete.update(progress["complete"])
        received.extend(progress["received"])
    received.sort()
    merged: list[list[int]] = []
    for shard, start, stop in received:
        if shard in complete:
            continue
        if merged and merged[-1][0] == shard and start <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], stop)
        else:
            merged.append([shard, start, stop])
    return {"cursor": None, "complete": sorted(complete), "received": merged}


class _Ranges:
    """Sorted, disjoint ``[start, stop)`` ranges of record numbers (never empty once added to),
    as two parallel lists so that lookups bisect in C."""

    __slots__ = ("starts", "stops")

    def __init__(self, starts: list[int] | None = None, stops: list[int] | None = None) -> None:
        self.starts: list[int] = starts if starts is not None else []
        self.stops: list[int] = stops if stops is not None else []

    def add(self, start: int, stop: int) -> None:
        """Add ``[start, stop)``, merging the ranges it overlaps or touches."""
        starts, stops = self.starts, self.stops
        first = bisect.bisect_left(stops, start)
        last = bisect.bisect_right(starts, stop)
        if first < last:
            start, stop = min(start, starts[first]), max(stop, stops[last - 1])
        starts[first:last] = [start]
        stops[first:last] = [stop]

    def covers(self, start: int, stop: int) -> bool:
        i = bisect.bisect_right(self.starts, start) - 1
        return i >= 0 and self.stops[i] >= stop

    def within(self, low: int, high: int) -> tuple[tuple[int, int], ...]:
        """The parts of the ranges inside ``[low, high)``."""
        first, last = bisect.bisect_right(self.stops, low), bisect.bisect_left(self.starts, high)
        return tuple((max(self.starts[i], low), min(self.stops[i], high)) for i in range(first, last))

    def drop_below(self, record: int) -> bool:
        """Forget the records below ``record``; whether any range is left."""
        i = bisect.bisect_right(self.stops, record)
        del self.starts[:i], self.stops[:i]
        if self.starts and self.starts[0] < record:
            self.starts[0] = record
        return bool(self.starts)
