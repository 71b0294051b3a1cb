"""Streaming sources: shards that are read in order, not indexed, interleaved like tf.data.

``Shards(shards, open_fn, cycle_length=4, block_length=None)`` is a source made of a list
of shards (file paths, URLs, anything picklable) and ``open_fn(shard) -> iterable of
records``. An epoch reads every shard once, ``cycle_length`` shards at a time, taking
``block_length`` records from each in turn (tf.data's ``interleave``). User docs:
``docs_streaming.md``.

How it fits the engine (everything else is reused as it is: workers, ring slots,
collation, leases, the coordinator's loop, worker-death recovery):

- The unit of work is a **block**: "records ``b*B .. b*B+B-1`` of shard ``s``"
  (``Block``), sent to a worker in place of a list of indices. ``produce.produce`` hands
  it to ``Shards.produce_block`` (the copy of the source in the worker), which reads the
  records from the shard's iterator, runs ``fn`` on each under its sample scope, and
  collates them into the task's ring slot. A block with fewer than ``B`` records (possibly
  none) is the shard's last.
- **Shard affinity.** A worker keeps each shard's iterator open between blocks
  (``_Reader``), and the coordinator sends a shard's blocks to the worker that opened it,
  so reading stays sequential. Any worker can still run any block: one without the shard
  open (the replacement of a dead worker) opens it again and skips the records before
  the block. Re-running a block is therefore safe as long as ``open_fn`` yields the same
  records every time, which is what makes worker deaths and ``task_timeout`` work here.
- ``StreamEpoch`` stands in for the coordinator's ``Epoch`` (a fixed list of batches):
  it opens shards as others end (at most ``cycle_length`` at once), picks each block's
  worker (``dispatch``, called by the coordinator's ``_dispatch``), and turns replies into
  what the consumer gets (``accept``/``deliver``). Its length is discovered as it goes:
  the epoch ends when every shard has delivered its last block.
- **Order.** ``ordered=True``: ``Interleave`` replays tf.data's deterministic interleave
  one block at a time (a reorder buffer keyed by ``(shard position, block)``).
  ``ordered=False``: blocks are used as they arrive.
- **Batching** (``_Output``): by default, blocks are cut and joined into batches of exactly
  ``batch_size`` records, in stream order; a batch inside one block is a zero-copy view of
  its slot, one that spans blocks is copied. With ``collate_fn`` or ``batch_fn`` (which
  run in the worker, on one block's records) batches never span blocks.
  ``shuffle_buffer=N`` mixes records through a buffer of N records in the loader's
  process (tf.data's ``shuffle``).
- **Resume** (``Loader.state_dict``): each batch carries the record ranges it holds; when
  the consumer takes it, they go into the epoch's ``StreamProgress`` (complete shards,
  the ordered interleave's cursor, record ranges received). A resumed epoch leaves the
  complete shards out, restarts the interleave at the cursor (or each shard at its
  first block not entirely received), and its blocks skip the records received: the
  worker advances the shard's iterator past them without running ``fn``.
"""
from __future__ import annotations

import bisect
import copy
import math
import queue
import reprlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import collate
from .collate import ARRAY, DICT, INLINE, SEQ
from .epochs import EmptyBatch as _Empty, EndOfEpoch, Epoch, EpochEnd, Failure, Job, Stream, iteration_over
from .errors import CollateError
from .produce import Produced, collate_privately, produce, run_batch_fn
from .reassembly import Progress
from .rng import SampleScope, buffer_rng, shuffle_rng

# How a worker lays out a block (``Shards._config``), chosen by ``StreamPlan``:
STACK = "stack"  # default collation: one stacked batch of the block's records (cut/joined by _Output)
CHUNKS = "chunks"  # collate_fn or batch_fn: the block's records in chunks of batch_size, each chunk a batch
RECORDS = "records"  # batch_size=None or shuffle_buffer: every record laid out on its own
_EXTRA_READERS = 8  # open iterators a worker keeps beyond 2 * cycle_length (LRU)
_PENDING_SPANS = 4096  # record ranges the consumer's StreamProgress gathers before it merges them
_SHARD_SHIFT = 40  # merging ranges, record r of shard s is at (s << 40) + r (shards of up to 2**40 records)
_END = object()  # a reader's end of shard


class RecordKey(tuple):
    """``(shard, record)``: a record's identity, the streaming counterpart of an index.

    ``shard`` is the shard's position in ``Shards.shards`` (not in the epoch's shuffled
    order), ``record`` its number within the shard. ``sample_rng()`` is seeded from
    ``(seed, epoch, shard, record)``; error messages name records by it.
    """

    __slots__ = ()

    def __new__(cls, shard: int, record: int) -> RecordKey:
        return tuple.__new__(cls, (shard, record))

    def __getnewargs__(self) -> tuple[int, int]:
        return tuple(self)

    def __repr__(self) -> str:
        return f"(shard {self[0]}, record {self[1]})"


class Block:
    """A task: records ``first .. first + length - 1`` of shard ``shard`` (its block ``number``).

    Sent to a worker in place of a list of indices. Iterating it gives the keys of the
    records it may hold (for the coordinator's messages about lost or stuck tasks).
    ``skip``: ``(start, stop)`` ranges of its records the consumer received before a
    resume; the worker reads past them (the shard's iterator only, not ``fn``) and leaves
    them out of the block's layout.
    """

    __slots__ = ("first", "length", "number", "shard", "skip")

    def __init__(self, shard: int, number: int, first: int, length: int,
                 skip: tuple[tuple[int, int], ...] = ()) -> None:
        self.shard = shard
        self.number = number
        self.first = first
        self.length = length
        self.skip = skip

    def __reduce__(self) -> tuple:
        return Block, (self.shard, self.number, self.first, self.length, self.skip)

    def __iter__(self):
        return (RecordKey(self.shard, r) for r in range(self.first, self.first + self.length))

    def skipped(self, record: int) -> bool:
        return any(start <= record < stop for start, stop in self.skip)

    def kept(self, read: int) -> range | list[int]:
        """The records a block's layout holds when ``read`` of its records could be read: all
        but the skipped ones, in order."""
        records = range(self.first, self.first + read)
        return [r for r in records if not self.skipped(r)] if self.skip else records

    def __repr__(self) -> str:
        return (f"block {self.number} of shard {self.shard} "
                f"(records {self.first}-{self.first + self.length - 1})")


class Shards:
    """A streaming source: ``open_fn(shard)`` yields the records of each shard, in order.

    Pass it as the ``source`` of ``procpipe.Loader``. An epoch reads every shard once
    (in a shuffled order with ``shuffle=True``), ``cycle_length`` shards at a time,
    interleaving ``block_length`` records from each (tf.data's ``interleave``); records
    then go through ``fn`` and batching as usual.

    Args:
        shards: a list of shards: paths, URLs, tuples of paths, anything picklable.
        open_fn: ``open_fn(shard) -> iterable of records`` (a generator, an open text
            file, ...); runs in the workers. It must yield the same records each time it
            is called for a shard (a shard is reopened after a worker crash).
        cycle_length: shards open at once (read concurrently, by different workers when
            there are enough). Fixed, so the order does not depend on the machine.
        block_length: records taken from a shard per turn, and the unit of work sent to
            a worker; ``None`` (default): the loader's ``batch_size`` (1 if that is None).
    """

    def __init__(self, shards: Iterable[Any], open_fn: Callable[[Any], Iterable[Any]], *,
                 cycle_length: int = 4, block_length: int | None = None) -> None:
        if isinstance(shards, (str, bytes)):
            raise TypeError(f"shards must be a list of shards, got the single {type(shards).__name__} "
                            f"{shards!r:.100}; write [path] for one shard")
        try:
            shards = list(shards)
        except TypeError:
            raise TypeError(f"shards must be a list (or iterable) of shards, got {type(shards).__name__}") from None
        if not callable(open_fn):
            raise TypeError(f"open_fn must be callable (open_fn(shard) -> iterable of records), "
                            f"got {type(open_fn).__name__}")
        _check_count("cycle_length", cycle_length)
        if block_length is not None:
            _check_count("block_length", block_length)
        self.shards = shards
        self.open_fn = open_fn
        self.cycle_length = cycle_length
        self.block_length = block_length
        self._config: tuple[int, str, int | None] | None = None  # set on the loader's copy (configured)
        self._readers: OrderedDict[tuple[int, int], _Reader] = OrderedDict()  # this process's open shards

    def __len__(self) -> int:
        """The number of shards (not of records, which is unknown until they are read)."""
        return len(self.shards)

    def __repr__(self) -> str:
        return (f"Shards({reprlib.repr(self.shards)}, {getattr(self.open_fn, '__name__', self.open_fn)!s}, "
                f"cycle_length={self.cycle_length}, block_length={self.block_length})")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_readers"] = OrderedDict()  # open iterators stay in the process that opened them
        return state

    def configured(self, block_length: int, mode: str, batch_size: int | None) -> Shards:
        """The copy a loader uses (and ships to its workers), with how blocks are laid out."""
        clone = copy.copy(self)
        clone._readers = OrderedDict()
        clone._config = (block_length, mode, batch_size)
        return clone

    # ------------------------------------------------------------------ reading (any process)
    def produce_block(self, spec: Any, scope: SampleScope, epoch: int, block: Block, buffer: Any | None,
                      capacity: int, status: Any | None = None) -> Produced:
        """Read ``block``, run ``fn`` on each record, collate into ``buffer`` (see ``produce.produce``).

        The layout is ``[SEQ, tuple, [[INLINE, (read, kept)], inner]]``: the number of
        records read (fewer than ``block_length`` means the shard has ended), how many of
        them the block holds (all but ``block.skip``), and the block's own layout of those
        (by mode: a stacked batch, a list of batches, or a list of records; ``[INLINE,
        None]`` if none is kept). A block with no record at all has no layout (``None``).
        """
        _, mode, batch_size = self._config
        fn, augment = spec.fn, getattr(spec, "augment", None)
        keys: list[RecordKey] = []
        samples: list[Any] = []
        reader = self._reader(epoch, block, scope, status)
        stop = block.first + block.length
        try:
            while reader.position < stop:
                key = RecordKey(block.shard, reader.position)
                scope.enter(epoch, key)  # the iterator's own draws and fn's share this record's generator
                if status is not None:
                    status[1] = reader.position
                record = reader.next(self, key)
                if record is _END:
                    break
                if block.skip and block.skipped(key[1]):
                    continue
                for stage, name in ((fn, "fn"), (augment, "augment")):
                    if stage is not None:
                        try:
                            record = stage(record)
                        except Exception as exc:
                            exc.add_note(f"procpipe: raised by {name} on record {key[1]} of shard {key[0]} "
                                         f"({self.name(key[0])}).")
                            raise
                keys.append(key)
                samples.append(record)
        finally:
            self._keep(epoch, block.shard, reader)
        scope.leave()
        if status is not None:
            status[1] = -1
        read = max(0, reader.position - block.first)
        if not read:
            return Produced(None, 0, False, [], [])
        if not samples:  # every record read was received before a resume
            return Produced([SEQ, tuple, [[INLINE, (read, 0)], [INLINE, None]]], 0, buffer is not None, [], [])
        if mode == CHUNKS:
            batches = [self._chunk(spec, epoch, samples[i:i + batch_size], keys[i:i + batch_size])
                       for i in range(0, len(samples), batch_size)]
            layout, nbytes, in_slot = collate.layout_value(batches, buffer, capacity)
        else:
            try:
                if mode == STACK:
                    layout, nbytes, in_slot = collate.layout_batch(samples, keys, buffer, capacity)
                else:
                    layout, nbytes, in_slot = collate.layout_value(samples, buffer, capacity)
            except Exception as exc:
                exc.add_note(f"procpipe: raised while collating {self._records(keys)}.")
                raise
        return Produced([SEQ, tuple, [[INLINE, (read, len(samples))], layout]], nbytes, in_slot, keys, [])

    def _chunk(self, spec: Any, epoch: int, samples: list, keys: list[RecordKey]) -> Any:
        """One batch of a block (``CHUNKS``): ``collate_fn`` (or the default collation) on
        ``samples``, then ``batch_fn`` if there is one, its ``batch_rng()`` seeded from the
        chunk's first record."""
        try:
            batch = collate_privately(spec.collate_fn, samples, keys)
        except Exception as exc:
            exc.add_note(f"procpipe: raised while collating {self._records(keys)}.")
            raise
        if spec.batch_fn is None:
            return batch
        return run_batch_fn(spec, epoch, keys[0], batch, self._records(keys))

    def _records(self, keys: list[RecordKey]) -> str:
        """``keys`` (records of one shard, in order) for a message: "records 4-7 of shard 2 (name)"."""
        shard = keys[0][0]
        return f"records {keys[0][1]}-{keys[-1][1]} of shard {shard} ({self.name(shard)})"

    def name(self, shard: int) -> str:
        return reprlib.repr(self.shards[shard])

    def _reader(self, epoch: int, block: Block, scope: SampleScope, status: Any | None) -> _Reader:
        """The shard's reader, positioned at the block's first record (opened again if need be)."""
        reader = self._readers.pop((epoch, block.shard), None)
        if reader is None or reader.position > block.first:
            if reader is not None:
                reader.close()
            scope.enter(epoch, RecordKey(block.shard, 0))
            try:
                reader = _Reader(iter(self.open_fn(self.shards[block.shard])))
            except Exception as exc:
                exc.add_note(f"procpipe: raised by open_fn opening shard {block.shard} ({self.name(block.shard)}).")
                raise
        try:
            while reader.position < block.first:  # a reopened shard: skip what earlier blocks had
                key = RecordKey(block.shard, reader.position)
                scope.enter(epoch, key)
                if status is not None:
                    status[1] = reader.position
                if reader.next(self, key) is _END:
                    break
        except BaseException:
            reader.close()
            raise
        return reader

    def _keep(self, epoch: int, shard: int, reader: _Reader) -> None:
        if reader.broken:
            return
        readers = self._readers
        readers[(epoch, shard)] = reader
        limit = 2 * self.cycle_length + _EXTRA_READERS
        while len(readers) > limit:
            _, old = readers.popitem(last=False)
            old.close()

    def close_readers(self) -> None:
        """Close every shard this process has open (``workers=0``: when an epoch is abandoned)."""
        readers, self._readers = self._readers, OrderedDict()
        for reader in readers.values():
            reader.close()


class _Reader:
    """One shard's iterator in one process, and how many records it has yielded."""

    __slots__ = ("broken", "done", "iterator", "position")

    def __init__(self, iterator: Any) -> None:
        self.iterator = iterator
        self.position = 0
        self.done = False  # the shard has ended: position is its record count
        self.broken = False  # the iterator raised: never used again

    def next(self, shards: Shards, key: RecordKey) -> Any:
        if self.done:
            return _END
        try:
            record = next(self.iterator)
        except StopIteration:
            self.done = True
            self.close()
            return _END
        except Exception as exc:
            self.broken = True
            self.close()
            exc.add_note(f"procpipe: raised while reading record {key[1]} of shard {key[0]} ({shards.name(key[0])}), "
                         "in the iterator open_fn returned.")
            raise
        self.position += 1
        return record

    def close(self) -> None:
        iterator, self.iterator = self.iterator, None
        close = getattr(iterator, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass


# ---------------------------------------------------------------------- the order
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
        slot = self.slots[self.turn]
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

    def __init__(self, order: list[int], cycle_length: int, block_length: int, ordered: bool,
                 state: dict | None = None) -> None:
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
            self._advance(ends)
            return
        for shard in [s for s, ranges in self.received.items() if ranges.starts[0] == 0]:
            end = ends.get(shard)
            if end is not None and self.received[shard].stops[0] >= end:
                self.complete.add(shard)
                del self.received[shard]

    def state(self) -> dict:
        """The plain-dict form (see the class docstring), canonical: the same progress gives an
        equal dict. Call ``settle`` first."""
        return {"cursor": None if self.cursor is None else self.cursor.state(),
                "complete": sorted(self.complete),
                "received": [[shard, start, stop] for shard in sorted(self.received)
                             for start, stop in zip(self.received[shard].starts, self.received[shard].stops)]}

    def skips(self, shard: int, block: int) -> tuple[tuple[int, int], ...]:
        """The ranges of records of ``block`` of ``shard`` already received (a ``Block``'s ``skip``)."""
        ranges = self.received.get(shard)
        return () if ranges is None else ranges.within(block * self.block_length, (block + 1) * self.block_length)

    def first_unreceived_block(self, shard: int) -> int:
        """The first block of ``shard`` not entirely received (where an unordered resume starts it)."""
        ranges = self.received.get(shard)
        return ranges.stops[0] // self.block_length if ranges is not None and ranges.starts[0] == 0 else 0

    def _merge_pending(self) -> None:
        """Merge the gathered ranges (vectorized: shards laid end to end on one line) into ``received``."""
        if not self.pending:
            return
        spans, self.pending = np.array(self.pending, dtype=np.int64), []
        offsets = spans[:, 0] << _SHARD_SHIFT
        order = np.argsort(spans[:, 1] + offsets, kind="stable")
        starts, stops = (spans[:, 1] + offsets)[order], (spans[:, 2] + offsets)[order]
        reach = np.maximum.accumulate(stops)
        first = np.flatnonzero(np.concatenate(([True], starts[1:] > reach[:-1])))
        last = np.append(first[1:], len(starts)) - 1
        for start, stop in zip(starts[first].tolist(), reach[last].tolist()):
            shard = start >> _SHARD_SHIFT
            offset = shard << _SHARD_SHIFT
            self.received.setdefault(shard, _Ranges()).add(start - offset, stop - offset)

    def _advance(self, ends: dict[int, int]) -> None:
        cursor, length = self.cursor, self.block_length
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


class _Ranges:
    """Sorted, disjoint ``[start, stop)`` ranges of record numbers (never empty once added to),
    as two parallel lists so that lookups bisect in C."""

    __slots__ = ("starts", "stops")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.stops: list[int] = []

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


# ---------------------------------------------------------------------- the epoch
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
    """A block of one shard as the coordinator's Job (``indices`` is the ``Block``)."""

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
        self.output = _Output(plan, self.number)
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
    def dispatch(self, co: Any) -> bool:
        """Send every block that can go now; True if it stopped for want of a slot or of consumption.

        ``co`` is the Coordinator: its ``workers``, ``tasks_per_worker``, ``max_outstanding``,
        ``n_workers``, ``_take_slot`` and ``_send`` are the dispatch primitives used here.
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
            no_slot = co.ring is None or not co.ring.free
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
                slot = co._take_slot(self)
                if slot is None:
                    slot = -1
                job = self._new_job(state)
                state.in_flight += 1
                self.in_flight += 1
            co._send(worker, job, slot)
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
            state = self.states[self.opened] = _Shard(self.opened, self.order[self.opened])
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

    def _worker(self, state: _Shard, co: Any) -> Any:
        """The worker reading ``state``'s shard (assigned on first use: the one with the fewest open shards)."""
        workers = co.workers
        if state.worker is not None:
            for w in workers:
                if w.index == state.worker:
                    if w.retiring:
                        break  # autotune is retiring it: the shard moves
                    return None if (w.fatal or w.killed_for or w.dead) else w
        # First block, or its worker is gone: the least loaded worker takes the shard (if it is
        # not the shard's first block, that worker opens the shard again and skips ahead).
        load = {w.index: 0 for w in workers}
        for other in self.states.values():
            if other.worker in load and other.end is None:
                load[other.worker] += 1
        usable = [w for w in workers if not (w.fatal or w.killed_for or w.dead or w.retiring)]
        if not usable:
            return None
        chosen = min(usable, key=lambda w: (load[w.index], len(w.tasks), w.index))
        state.worker = chosen.index
        return chosen

    # ------------------------------------------------------------------ replies
    def ring_slot_bytes(self, layout: list, nbytes: int) -> int | None:
        """Size the ring from the first block holding records: scaled up to a full block if it
        held fewer (a shard's short last block, or records skipped after a resume)."""
        kept = layout[2][0][1][1]
        if not kept:
            return None
        return math.ceil(nbytes * self.block_length / kept) if kept < self.block_length else nbytes

    def accept(self, job: BlockJob, layout: list, lease: Any, skipped: int) -> None:
        """A block's records arrived (``lease``: its ring slot, or None when inline)."""
        if self.jobs.pop(job.seq, None) is None or self.finished:
            return
        (read, _), inner = layout[2][0][1], layout[2][1]
        self._result(job, read, (job.indices.kept(read), inner, lease))

    def deliver(self, seq: int, item: Any) -> None:
        """A block with no record (``_Empty``), or a failed one (``Failure``)."""
        job = self.jobs.pop(seq, None)
        if job is None or self.finished:
            return
        if item is _Empty:
            self._result(job, 0, None)
        else:
            self._result(job, None, item)

    def _result(self, job: BlockJob, count: int | None, payload: Any) -> None:
        """``count`` records read; ``payload``: ``(records kept, layout, lease)``, None if
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
        records, inner, lease = payload
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

    def done_seqs(self) -> Progress:
        return Progress(self.progress)

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


# ---------------------------------------------------------------------- the plan
class StreamPlan:
    """What a Loader needs for a ``Shards`` source; it stands where the Sampler would.

    Checks what streaming does not support and decides how blocks are laid out.
    ``batches(epoch)`` is the epoch's shard order (the ``Stream`` builds each epoch from it,
    as ``epoch_class``); ``source`` is the configured copy of the Shards that the workers
    (or ``workers=0``) read from.
    """

    epoch_class = StreamEpoch

    def __init__(self, shards: Shards, *, batch_size: int | None, shuffle: bool, seed: int, drop_last: bool,
                 reshuffle: bool = True, shard: tuple[int, int] | None = None, collate_fn: Callable | None = None,
                 shuffle_buffer: int | None = None, on_error: str = "raise", speculate: float | None = None,
                 batches: Any = None, batch_fn: Any = None, cache: Any = None) -> None:
        unsupported = [
            (batches is not None, "batches=... (its records have no indices to choose from)"),
            (on_error != "raise", "on_error='skip' (skip bad records inside open_fn or fn instead)"),
            (speculate is not None, ("speculate (a shard is read in order by the worker that opened it, so a "
                                     "block cannot be raced on another worker without reading the shard again; "
                                     "with ordered=False a slow shard does not hold back the others)")),
            (batch_fn is not None and shuffle_buffer is not None,
             ("batch_fn together with shuffle_buffer (the shuffle buffer puts batches together in the loader's "
              "process, after the workers, so there is no batch in a worker for batch_fn to run on; apply the "
              "function to each batch in your loop, or transform records in fn)")),
            (cache not in (None, False), "cache (it keeps fn's output per index)"),
        ]
        for bad, what in unsupported:
            if bad:
                raise ValueError(f"a streaming source (procpipe.Shards) does not support {what}")
        if shuffle_buffer is not None:
            _check_count("shuffle_buffer", shuffle_buffer)
        self.shards = shards
        self.cycle_length = shards.cycle_length
        self.block_length = shards.block_length or batch_size or 1
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.reshuffle = bool(reshuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.shard = None if shard is None else tuple(shard)
        self.collate_fn = collate_fn
        self.shuffle_buffer = shuffle_buffer
        if shuffle_buffer is not None or batch_size is None:
            self.mode = RECORDS
        elif collate_fn is not None or batch_fn is not None:
            self.mode = CHUNKS
        else:
            self.mode = STACK
        self.source = shards.configured(self.block_length, self.mode, batch_size)

    def __len__(self) -> int:
        raise TypeError("a Loader over a streaming source (procpipe.Shards) has no len(): the number of "
                        "records is only known once every shard has been read")

    def batches(self, epoch: int) -> list[int]:
        """The shards of ``epoch``, in the order they are opened (indices into ``Shards.shards``)."""
        n = len(self.shards.shards)
        if self.shuffle:
            order = shuffle_rng(self.seed, epoch if self.reshuffle else 0).permutation(n)
        else:
            order = np.arange(n)
        if self.shard is not None:
            rank, world = self.shard
            order = order[rank::world]
        return order.tolist()

    def settings(self) -> dict[str, Any]:
        """What a saved state (``Loader.state_dict``) must match to be resumed with this plan."""
        return {"shards": len(self.shards.shards), "batch_size": self.batch_size, "shuffle": self.shuffle,
                "seed": self.seed, "drop_last": self.drop_last, "shard": None if self.shard is None else list(self.shard),
                "reshuffle": self.reshuffle, "cycle_length": self.cycle_length, "block_length": self.block_length,
                "mode": self.mode, "shuffle_buffer": self.shuffle_buffer}

    def check_progress(self, state: Any, epoch: int) -> dict | None:
        """A saved ``StreamProgress.state()`` of ``epoch`` (or None), checked against this plan's
        shards; raises ``ValueError`` naming what is wrong."""
        if state is None:
            return None
        order = self.batches(epoch)

        def corrupt(what: str) -> ValueError:
            return ValueError(f"corrupt procpipe Loader state: the stream progress of epoch {epoch} {what}: "
                              f"{state!r:.300}")

        if not isinstance(state, dict) or set(state) != {"cursor", "complete", "received"}:
            raise corrupt("is not a dict with keys cursor, complete and received")
        in_order = set(order)
        complete = state["complete"]
        if not (isinstance(complete, list) and all(_is_count(s, 0) and s in in_order for s in complete)
                and complete == sorted(set(complete))):
            raise corrupt("has complete shards that are not sorted shards of the epoch")
        received, previous = state["received"], None
        for entry in received if isinstance(received, list) else [None]:
            if not (isinstance(entry, list) and len(entry) == 3 and all(_is_count(x, 0) for x in entry)
                    and entry[0] in in_order and entry[0] not in complete and entry[1] < entry[2]
                    and (previous is None or (previous[0], previous[2]) < (entry[0], entry[1]))):
                raise corrupt(f"has received entry {entry!r} (not [shard, start, stop] ranges, sorted and merged)")
            previous = entry
        if state["cursor"] is not None:
            self._check_cursor(state["cursor"], len(order) - len(complete), corrupt)
        return state

    def _check_cursor(self, cursor: Any, shards: int, corrupt: Callable[[str], ValueError]) -> None:
        slots_expected = max(1, min(self.cycle_length, shards))
        ok = isinstance(cursor, list) and len(cursor) == 3 and _is_count(cursor[0], 0) and _is_count(cursor[1], 0)
        if ok:
            turn, opened, slots = cursor
            ok = (turn < slots_expected and opened <= shards and isinstance(slots, list)
                  and len(slots) == slots_expected)
        if ok:
            held = [slot for slot in slots if slot is not None]
            ok = (all(isinstance(slot, list) and len(slot) == 2 and _is_count(slot[0], 0) and _is_count(slot[1], 0)
                      and slot[0] < opened for slot in held)
                  and len({slot[0] for slot in held}) == len(held))
        if not ok:
            raise corrupt(f"has cursor {cursor!r} (not an interleave over {shards} shards, cycle_length "
                          f"{self.cycle_length})")


# ---------------------------------------------------------------------- batching
class _Output:
    """Turns blocks, in the order they are used, into what the consumer gets.

    Each item comes out as ``(batch, record count, coverage)``: coverage is the list of
    ``(shard, start, stop)`` record ranges in the batch, plus those ``drop_last`` left out
    since the previous item (so that a resume skips them too; see ``StreamProgress``).

    - ``STACK``: batches of exactly ``batch_size`` records of the stream (the last one
      smaller, or dropped with ``drop_last``). A batch inside one block is a zero-copy
      slice of its slot; one that spans blocks is joined (copied) here.
    - ``CHUNKS``: the worker's batches (collate_fn's and/or batch_fn's), each block's last
      one possibly smaller (dropped with ``drop_last``).
    - ``RECORDS`` without shuffle: one item per record (``batch_size=None``), views of the slot.
    - ``shuffle_buffer``: records are copied out of their slot into a buffer of N records;
      each new record, once the buffer is full, pushes out a random one (tf.data's
      ``shuffle``), drawn from ``(seed, epoch)``; the buffer is drained at the end in random
      order. Records out of the buffer are batched here (default collation, or collate_fn).
    """

    def __init__(self, plan: StreamPlan, epoch: int) -> None:
        self.mode = plan.mode
        self.batch_size = plan.batch_size
        self.drop_last = plan.drop_last
        self.collate_fn = plan.collate_fn
        self.capacity = plan.shuffle_buffer
        self.parts: deque[list] = deque()  # STACK: [layout, lease, start row, stop row, shard, records] not yet batched
        self.pending = 0
        self.dropped: list[tuple[int, int, int]] = []  # records drop_last left out since the last item
        self.buffer: list[tuple[RecordKey, Any]] = []  # shuffle buffer
        self.batch: list[tuple[RecordKey, Any]] = []  # records out of the buffer, not yet a batch
        self.rng = buffer_rng(plan.seed, epoch) if plan.shuffle_buffer is not None else None
        self.draws = np.empty(0)
        self.drawn = 0

    def add(self, block: Block, records: range | list[int], inner: list, lease: Any) -> list[tuple[Any, int, list]]:
        """A block's layout ``inner`` holding ``records`` (record numbers in its shard): the items it completes."""
        shard = block.shard
        out: list[tuple[Any, int, list]] = []
        if self.capacity is not None:
            for record, node in zip(records, inner[2]):
                self._shuffled((RecordKey(shard, record), _own(collate.build(node, lease))), out)
        elif self.mode == STACK:
            self.parts.append([inner, lease, 0, len(records), shard, records])
            self.pending += len(records)
            while self.pending >= self.batch_size:
                self._item(*self._take(self.batch_size), self.batch_size, out)
        elif self.mode == CHUNKS:
            size = self.batch_size
            for i, node in enumerate(inner[2]):
                chunk = _spans(shard, records[i * size:(i + 1) * size])
                if len(records) - i * size >= size or not self.drop_last:
                    self._item(collate.build(node, lease), chunk, min(size, len(records) - i * size), out)
                else:
                    self.dropped += chunk
        else:
            for record, node in zip(records, inner[2]):
                self._item(collate.build(node, lease), [(shard, record, record + 1)], 1, out)
        return out

    def flush(self) -> list[tuple[Any, int, list]]:
        out: list[tuple[Any, int, list]] = []
        if self.capacity is not None:
            buffer = self.buffer
            while buffer:
                i = self._draw(len(buffer))
                buffer[i], buffer[-1] = buffer[-1], buffer[i]
                self._batched(buffer.pop(), out)
            if self.batch and not self.drop_last:
                self._item(self._collate(self.batch), _key_spans(self.batch), len(self.batch), out)
            self.batch = []
        elif self.mode == STACK and self.pending and not self.drop_last:
            n = self.pending
            self._item(*self._take(n), n, out)
        return out

    def clear(self) -> None:
        self.parts.clear()
        self.pending = 0
        self.dropped = []
        self.buffer = []
        self.batch = []

    def _item(self, batch: Any, coverage: list, records: int, out: list) -> None:
        if self.dropped:
            coverage, self.dropped = self.dropped + coverage, []
        out.append((batch, records, coverage))

    # -- STACK ---------------------------------------------------------------------
    def _take(self, n: int) -> tuple[Any, list]:
        """The next ``n`` records, and their ranges: a view of one block's slot, or a copy joining several blocks."""
        parts = self.parts
        self.pending -= n
        first = parts[0]
        if first[3] - first[2] >= n:
            layout, lease, start, _, shard, records = first
            first[2] += n
            if first[2] == first[3]:
                parts.popleft()
            return collate.build(_rows(layout, start, start + n), lease), _spans(shard, records[start:start + n])
        pieces, coverage = [], []
        while n:
            part = parts[0]
            k = min(n, part[3] - part[2])
            pieces.append((part[0], part[1], part[2], part[2] + k))
            coverage += _spans(part[4], part[5][part[2]:part[2] + k])
            part[2] += k
            n -= k
            if part[2] == part[3]:
                parts.popleft()
        return collate.build(_join(pieces, ()), None), coverage

    # -- shuffle buffer --------------------------------------------------------------
    def _draw(self, n: int) -> int:
        if self.drawn == len(self.draws):
            self.draws = self.rng.random(1024)
            self.drawn = 0
        u = self.draws[self.drawn]
        self.drawn += 1
        return int(u * n)

    def _shuffled(self, record: tuple, out: list) -> None:
        buffer = self.buffer
        if len(buffer) < self.capacity:
            buffer.append(record)
            return
        i = self._draw(len(buffer))
        record, buffer[i] = buffer[i], record
        self._batched(record, out)

    def _batched(self, record: tuple, out: list) -> None:
        if self.batch_size is None:
            self._item(record[1], _key_spans([record]), 1, out)
            return
        self.batch.append(record)
        if len(self.batch) == self.batch_size:
            self._item(self._collate(self.batch), _key_spans(self.batch), self.batch_size, out)
            self.batch = []

    def _collate(self, records: list[tuple[RecordKey, Any]]) -> Any:
        return collate_privately(self.collate_fn, [s for _, s in records], [k for k, _ in records])


def _spans(shard: int, records: range | list[int]) -> list[tuple[int, int, int]]:
    """``records`` (ascending record numbers of ``shard``) as ``(shard, start, stop)`` ranges."""
    if isinstance(records, range):
        return [(shard, records.start, records.stop)] if records else []
    spans: list[tuple[int, int, int]] = []
    for record in records:
        if spans and spans[-1][2] == record:
            spans[-1] = (shard, spans[-1][1], record + 1)
        else:
            spans.append((shard, record, record + 1))
    return spans


def _key_spans(records: list[tuple[RecordKey, Any]]) -> list[tuple[int, int, int]]:
    """The records (``(key, value)`` pairs) of a shuffle-buffer batch, one range each
    (``StreamProgress`` merges them)."""
    return [(key[0], key[1], key[1] + 1) for key, _ in records]


def _rows(node: list, start: int, stop: int) -> list:
    """The layout of records ``start:stop`` of a stacked batch: arrays stay views of the same slot."""
    kind = node[0]
    if kind == ARRAY:
        dtype, shape = np.dtype(node[1]), tuple(node[2])
        row = dtype.itemsize * math.prod(shape[1:])
        return [ARRAY, node[1], (stop - start,) + shape[1:], node[3] + start * row]
    if kind == INLINE:
        return [INLINE, node[1][start:stop]]
    return [kind, node[1], [_rows(child, start, stop) for child in node[2]]]


def _join(pieces: list[tuple[list, Any, int, int]], path: tuple) -> list:
    """One layout (arrays inline, copied) of consecutive record ranges of several stacked blocks."""
    nodes = [p[0] for p in pieces]
    first = nodes[0]
    if first[0] in (ARRAY, INLINE):
        values = [collate.build(_rows(node, a, b), lease) for node, lease, a, b in pieces]
        if all(isinstance(v, np.ndarray) for v in values):
            kinds = {(v.dtype.str, v.shape[1:]) for v in values}
            if len(kinds) > 1:
                raise _join_error(path, "arrays of " + " and ".join(
                    f"shape {('N',) + s} dtype {np.dtype(d)}" for d, s in sorted(kinds)))
            return [INLINE, np.concatenate(values)]
        if all(isinstance(v, list) for v in values):
            return [INLINE, [x for v in values for x in v]]
        raise _join_error(path, "numbers in one block and other objects in another")
    if any(node[0] != first[0] for node in nodes):
        raise _join_error(path, "a mapping in one block and a sequence in another")
    if first[0] == DICT:
        keys = first[1]
        children = []
        for i, key in enumerate(keys):
            column = []
            for node, lease, a, b in pieces:
                if set(node[1]) != set(keys):
                    raise _join_error(path, f"keys {sorted(map(str, keys))} and {sorted(map(str, node[1]))}")
                column.append((node[2][list(node[1]).index(key)], lease, a, b))
            children.append(_join(column, path + (key,)))
        return [DICT, keys, children]
    if any(node[1] is not first[1] or len(node[2]) != len(first[2]) for node in nodes):
        raise _join_error(path, "sequences of different types or lengths")
    return [SEQ, first[1], [_join([(node[2][i], lease, a, b) for node, lease, a, b in pieces], path + (i,))
                            for i in range(len(first[2]))]]


def _join_error(path: tuple, what: str) -> CollateError:
    where = "sample" + "".join(f"[{p!r}]" for p in path)
    return CollateError(
        f"cannot batch {where} across two blocks of the stream: {what}. Records that share a batch must have "
        "the same structure, shapes and dtypes; make them so in fn, or pass collate_fn=... (batches then "
        "never span two blocks)."
    )


def _own(value: Any) -> Any:
    """``value`` with every array copied out of its ring slot (records kept in the shuffle buffer)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _own(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_own(v) for v in value]
    if isinstance(value, tuple):
        items = [_own(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


# ---------------------------------------------------------------------- workers=0
class InlineStream:
    """``workers=0`` for a streaming source: the same ``Stream`` and epochs as with workers,
    driven in the calling thread: each time the stream's queue is empty, the block the
    interleave waits for is read here (``produce``, so ``Shards.produce_block``). The
    output is identical to that of workers (in the deterministic order, whatever
    ``ordered``). The Loader uses it like its own epoch iterators.
    """

    def __init__(self, loader: Any, number: int, done: dict | None = None, until: int | None = None,
                 ahead: dict[int, dict] | None = None) -> None:
        plan: StreamPlan = loader._sampler
        self._loader = loader
        self._coordinator = None
        self._spec = loader._spec
        self._scope = SampleScope(self._spec.seed)
        self._with_epoch = loader._with_epoch
        self._stream = Stream(-1, plan, number, until, True, plan.batches(number), done, ahead)
        self._stream.open(self._stream.first)
        self._epoch = self._stream.first
        self.number = number
        self.batch_count = 0
        self._done = False
        self._complete = False  # every batch of the stream was returned
        self._cancelled: str | None = None
        loader._last_counters = self._epoch.counters
        self._epoch_set = loader._epoch = number + 1

    def __iter__(self) -> InlineStream:
        return self

    def __next__(self) -> Any:
        if self._done:
            iteration_over(self._cancelled)
        stream = self._stream
        started = time.perf_counter()
        while True:
            try:
                item = stream.out.get_nowait()
            except queue.Empty:
                try:
                    self._load()
                except BaseException:
                    self._stop()
                    raise
                continue
            if type(item) is tuple:
                epoch, seq, batch = item
                epoch.counters.wait_s += time.perf_counter() - started
                epoch.mark_consumed(seq)
                stream.consumed += 1
                if epoch is not self._epoch:  # the first batch of the next epoch
                    self._epoch, self.number = epoch, epoch.number
                    self._loader._last_counters = epoch.counters
                    self._move_epoch(epoch.number + 1)
                return (epoch.number, batch) if self._with_epoch else batch
            if isinstance(item, EpochEnd):
                item.epoch.counters.ended = time.perf_counter()
                continue
            self._stop()
            if item is EndOfEpoch:
                self._complete = True
                self._move_epoch(stream.until if stream.until is not None else stream.next_number)
                raise StopIteration
            raise item.exc  # a Failure

    def _load(self) -> None:
        """Read the block the open epoch waits for (opening the next epoch when one is done)."""
        epoch = self._stream.fresh()
        if epoch is None:
            raise RuntimeError("procpipe: internal error: a streaming epoch had nothing left to read "
                               "but did not end")
        job = epoch.inline_job()
        scope = self._scope
        try:
            produced = produce(self._spec, scope, epoch.number, job.indices, None, 0)
        except Exception as exc:
            scope.leave()
            exc.add_note(f"procpipe: raised in the calling process (workers=0) while loading {job.indices} "
                         f"(epoch {epoch.number}).")
            raise
        if produced.layout is None:
            epoch.deliver(job.seq, _Empty)
        else:
            epoch.accept(job, produced.layout, None, 0)

    def _move_epoch(self, epoch: int) -> None:
        """Move ``loader.epoch`` along, unless the user chose one with ``set_epoch`` meanwhile."""
        if self._loader._epoch == self._epoch_set:
            self._loader._epoch = self._epoch_set = epoch

    def _stop(self) -> None:
        self._done = True
        self._stream.finish()
        self._spec.source.close_readers()

    def owns_epoch(self) -> bool:
        """``loader.epoch`` is still what this iteration made it (for ``state_dict``)."""
        return self._loader._epoch == self._epoch_set

    def resume_point(self) -> tuple[int, Any, dict[int, Any], int | None] | None:
        """As ``_EpochIterator.resume_point``: the epochs come in order, so the oldest one the
        consumer is not past is the one it is in."""
        if self._complete:
            return None
        return self._stream.resume_point(self._epoch.number)

    def done_seqs(self) -> Progress:
        return self._epoch.done_seqs()

    def cancel(self, why: str) -> None:
        if not self._done:
            self._cancelled = why
            self._stop()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self._spec.source.close_readers()


def _check_count(name: str, value: Any) -> None:
    if not _is_count(value, 1):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _is_count(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
