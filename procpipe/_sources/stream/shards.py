"""The streaming source and reading it, in any process: ``Shards`` (its tasks, ``Block`` and
``RecordKey``, are in blocks.py).

Where it sits in the data path: the user passes a ``Shards`` as the Loader's source;
``ShardOrder`` (shard_order.py) keeps a configured copy (``Shards.configured``: the block length
and how a worker lays a block out, ``STACK``, ``CHUNKS`` or ``RECORDS``), which is
shipped to every worker and is the workers' producer (its kind, stream_kind.py, puts it in
``WorkerSpec.producer``). The coordinator sends each worker ``Block`` tasks (shard_plan.py);
in the worker (or in the calling process with ``workers=0``) ``produce.produce`` hands a
block to ``Shards.produce_block``, which reads its records from the shard's iterator
(``_Reader``, kept open between blocks: shard affinity), runs each through the one per-sample
pipeline (_worker/stages.py: the cache or ``fn``, ``augment``, skip on error) under its sample
scope (seeded from its ``RecordKey``), and collates them into the task's ring slot. Turning
blocks into batches is block_batching.py's, in the loader's process.
"""

from __future__ import annotations

import copy
import reprlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from ..._core import collate
from ..._core.checks import check_int, is_count
from ..._core.notes import add_note
from ..._core.rng import SampleScope
from ..._core.tree import INLINE
from ..._worker.index_producer import first_record_cached, first_scope
from ..._worker.produce import collate_privately, run_batch_fn
from ..._worker.stages import SKIPPED, run_sample
from ..._worker.worker_spec import GROWING, PER_RECORD, CacheKind, Produced, WorkerSpec
from ...errors import ShardLengthError
from .blocks import Block, BlockRead, RecordKey, block_layout

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; typing_extensions is read by type checkers only

    from ..._worker.worker_spec import SampleCache

# How a worker lays out a block (``Shards._config``), chosen by ``ShardOrder``:
STACK = "stack"  # default collation: one stacked batch of the block's records (cut/joined by Output)
CHUNKS = "chunks"  # collate_fn or batch_fn: the block's records in chunks of batch_size, each chunk a batch
RECORDS = "records"  # batch_size=None or shuffle_buffer: every record laid out on its own
_EXTRA_READERS = 8  # open iterators a worker keeps beyond 2 * cycle_length (LRU)
_END = object()  # a reader's end of shard


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
        lengths: optional, the number of records of each shard (one int per shard). It
            gives the loader a ``len()``, and it is a promise: a shard that yields fewer or
            more records raises ``ShardLengthError`` (the epoch never ends short silently).
    """

    # A block may run again in another process, which opens its shard and skips ahead (worker
    # deaths, ``speculate``). A subclass whose shards cannot be read again says False (``reopening``).
    replayable = True

    def __init__(
        self,
        shards: Iterable[Any],
        open_fn: Callable[[Any], Iterable[Any]],
        *,
        cycle_length: int = 4,
        block_length: int | None = None,
        lengths: Iterable[int] | None = None,
    ) -> None:
        if isinstance(shards, (str, bytes)):
            raise TypeError(
                f"shards must be a list of shards, got the single {type(shards).__name__} "
                f"{shards!r:.100}; write [path] for one shard"
            )
        try:
            shards = list(shards)
        except TypeError:
            raise TypeError(f"shards must be a list (or iterable) of shards, got {type(shards).__name__}") from None
        if not callable(open_fn):
            raise TypeError(
                f"open_fn must be callable (open_fn(shard) -> iterable of records), got {type(open_fn).__name__}"
            )
        check_int("cycle_length", cycle_length, 1)
        if block_length is not None:
            check_int("block_length", block_length, 1)
        self.shards = shards
        self.lengths = _check_lengths(lengths, len(shards))
        self.open_fn = open_fn
        self.cycle_length = cycle_length
        self.block_length = block_length
        self._config: tuple[int, str, int | None] | None = None  # set on the loader's copy (configured)
        self._offsets: list[int] | None = None  # cache=...: each shard's first cache index (cache_index)
        self._readers: OrderedDict[tuple[int, int], _Reader] = OrderedDict()  # this process's open shards

    def __len__(self) -> int:
        """The number of shards (not of records, which is unknown until they are read)."""
        return len(self.shards)

    def __repr__(self) -> str:
        return (
            f"Shards({reprlib.repr(self.shards)}, {getattr(self.open_fn, '__name__', self.open_fn)!s}, "
            f"cycle_length={self.cycle_length}, block_length={self.block_length}"
            + ("" if self.lengths is None else f", lengths={reprlib.repr(self.lengths)}")
            + ")"
        )

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_readers"] = OrderedDict()  # open iterators stay in the process that opened them
        return state

    def configured(self, block_length: int, mode: str, batch_size: int | None) -> Self:
        """The copy a loader uses (and ships to its workers), with how blocks are laid out."""
        clone = copy.copy(self)
        clone._readers = OrderedDict()
        clone._config = (block_length, mode, batch_size)
        return clone

    # ------------------------------------------------------------------ reading (any process)
    @property
    def cache_kind(self) -> CacheKind:
        """The producer's cache layout (_worker/worker_spec.py ``Producer``): per record, or growing (no lengths)."""
        return GROWING if self.lengths is None else PER_RECORD

    def produce(self, spec: WorkerSpec, scope: SampleScope, epoch: int, task: Any, *args: Any) -> Produced:
        """The producer's task (_worker/worker_spec.py ``Producer``): a ``Block``, read by ``produce_block``."""
        return self.produce_block(spec, scope, epoch, task, *args)

    def produce_block(
        self,
        spec: WorkerSpec,
        scope: SampleScope,
        epoch: int,
        block: Block,
        buffer: Any | None,
        capacity: int,
        status: Any | None = None,
    ) -> Produced:
        """Read ``block``, run ``fn`` on each record, collate into ``buffer`` (see ``produce.produce``).

        The layout is a block layout (``block_layout``): a ``BlockRead`` (records read, fewer
        than ``block_length`` meaning the shard has ended; how many of them the block holds,
        all but ``block.skip``; the records ``on_error="skip"`` left out), and the block's own
        layout of those (by mode: a stacked batch, a list of batches, or a list of records;
        ``[INLINE, None]`` if none is kept). A block with no record at all has no layout (``None``).
        """
        _, mode, batch_size = cast("tuple[int, str, int | None]", self._config)  # (set: the loader's copy runs)
        skipped: list[tuple[RecordKey, Exception]] = []  # on_error="skip": records whose fn or augment raised
        read_all = self._from_cache(spec, scope, epoch, block, skipped) if spec.cache is not None else None
        if read_all is None:
            skipped.clear()
        keys, samples, read = read_all or self._read(spec, scope, epoch, block, status, skipped)
        failed = tuple(key[1] for key, _ in skipped)
        if not read:
            return Produced(None, 0, False, [], [])
        if not samples:  # every record read was received before a resume
            return Produced(
                block_layout(BlockRead(read, 0, failed), [INLINE, None]), 0, buffer is not None, [], skipped
            )
        if mode == CHUNKS:
            size = cast(int, batch_size)  # (CHUNKS has a batch size)
            batches = [
                self._chunk(spec, scope, epoch, samples[i : i + size], keys[i : i + size])
                for i in range(0, len(samples), size)
            ]
            scope.leave()
            layout, nbytes, in_slot = collate.layout_value(batches, buffer, capacity)
        else:
            try:
                if mode == STACK:
                    layout, nbytes, in_slot = collate.layout_batch(samples, keys, buffer, capacity)
                else:
                    layout, nbytes, in_slot = collate.layout_value(samples, buffer, capacity)
            except Exception as exc:
                add_note(exc, f"procpipe: raised while collating {self._records(keys)}.")
                raise
        return Produced(block_layout(BlockRead(read, len(samples), failed), layout), nbytes, in_slot, keys, skipped)

    def _read(
        self, spec: WorkerSpec, scope: SampleScope, epoch: int, block: Block, status: Any | None, skipped: list
    ) -> tuple[list[RecordKey], list[Any], int]:
        """Read ``block`` from its shard's iterator and run the stages on each record kept:
        ``(keys, samples, records read)``. With ``cache=...``, ``fn``'s output is taken
        from the cache when it is there, else computed and stored. With ``on_error="skip"``
        a record whose stages raise is left out and put in ``skipped`` with its exception
        (an error of the iterator itself still raises: the shard cannot be read past it)."""
        keys: list[RecordKey] = []
        samples: list[Any] = []
        cache = spec.cache
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
                index = key if cache is None else self.cache_index(key)
                record = run_sample(spec, scope, index, {index: record}, key, skipped, self.describe)
                if record is not SKIPPED:
                    keys.append(key)
                    samples.append(record)
        finally:
            self._keep(epoch, block.shard, reader)
        if reader.done and self.lengths is None and cache is not None:
            cache.set_end(block.shard, reader.position)  # (a growing cache: where the shard ends)
        scope.leave()
        if status is not None:
            status[1] = -1
        return keys, samples, max(0, reader.position - block.first)

    def _from_cache(
        self, spec: WorkerSpec, scope: SampleScope, epoch: int, block: Block, skipped: list
    ) -> tuple[list[RecordKey], list[Any], int] | None:
        """``block`` entirely from the cache, without reading its shard (the lengths, a
        promise checked when the cache was filled, say where the shard ends); None if one
        of its records is not cached yet (the block is then read)."""
        cache = cast("SampleCache", spec.cache)  # (called with a cache only)
        known = self.lengths[block.shard] if self.lengths is not None else cache.shard_end(block.shard)
        end = block.first + block.length if known is None else min(block.first + block.length, known)
        keys: list[RecordKey] = []
        samples: list[Any] = []
        for record in range(block.first, end):
            if block.skip and block.skipped(record):
                continue
            key = RecordKey(block.shard, record)
            sample = cache.get(self.cache_index(key))
            if sample is None:
                return None
            keys.append(key)
            samples.append(sample)
        if spec.augment is not None:  # the rest of the stages (cached: fn's output), through the one pipeline
            pairs, keys, samples = zip(keys, samples, strict=True), [], []
            for key, cached in pairs:
                scope.enter(epoch, key)
                sample = run_sample(spec, scope, key, None, key, skipped, self.describe, cached)
                if sample is not SKIPPED:
                    keys.append(key)
                    samples.append(sample)
            scope.leave()
        return keys, samples, max(0, end - block.first)

    # ------------------------------------------------------------------ the cache (cache=...)
    def cache_length(self) -> int:
        """Records in all shards: the cache's length (``ValueError`` without ``lengths``)."""
        if self.lengths is None:
            raise ValueError(
                "cache=... with a streaming source needs the shards' record counts, to lay the cache "
                "file out: pass Shards(..., lengths=[records of each shard])"
            )
        return sum(self.lengths)

    def cache_index(self, key: RecordKey) -> int | RecordKey:
        """The cache's index of record ``(shard, record)``: the records of the shards before it, plus ``record``;
        the key itself without ``lengths`` (the cache then grows as records arrive: _worker/stream_cache.py)."""
        if self.lengths is None:
            return key
        if self._offsets is None:
            self._offsets = [0]
            for n in self.lengths:
                self._offsets.append(self._offsets[-1] + n)
        return self._offsets[key[0]] + key[1]

    def first_cached(self, spec: WorkerSpec) -> tuple[Any, Any]:
        """The reader's first cached sample (_worker/index_producer.py): ``fn`` of the first record."""
        scope = first_scope(spec)
        return first_record_cached(spec, scope, cast("tuple[Any, Any, Any]", self.first_record(scope)))

    def first_keyed(self, spec: WorkerSpec) -> tuple[RecordKey, Any] | None:
        """A growing cache's first entry (stream_cache.py ``StreamCache.create``): ``(key, fn(record))``
        of the stream's first record, computed here with a worker's epoch-0 seeding; None if every
        shard is empty."""
        scope = SampleScope(spec.seed, seed_globals=spec.seed_globals, restore_globals=True)
        found = self.first_record(scope)
        if found is None:
            return None
        _, sample = first_record_cached(spec, scope, found)
        return found[1], sample

    def first_record(self, scope: SampleScope) -> tuple[Any, RecordKey, Any] | None:
        """``(cache index, key, record)`` of the first record of the first non-empty shard, read here
        (the calling process lays the cache out from ``fn`` of it); None if every shard is empty (no lengths)."""
        for shard in range(len(self.shards)):
            if self.lengths is not None and not self.lengths[shard]:
                continue
            key = RecordKey(shard, 0)
            scope.enter(0, key)
            try:
                iterator = iter(self.open_fn(self.shards[shard]))
                reader = _Reader(iterator)
                record = reader.next(self, key)
                reader.close()
            except Exception as exc:
                add_note(
                    exc,
                    f"procpipe: raised in the calling process while reading record 0 of shard {shard} "
                    f"({self.name(shard)}) to lay out the cache (cache=...).",
                )
                raise
            finally:
                scope.leave()
            if record is _END and self.lengths is None:
                continue
            if record is _END:
                raise ShardLengthError(self.length_mismatch(shard, "ended after 0 records"))
            return self.cache_index(key), key, record
        if self.lengths is None:
            return None
        raise ValueError("cache=...: every shard is empty (lengths are all 0), there is nothing to cache")

    def _chunk(self, spec: WorkerSpec, scope: SampleScope, epoch: int, samples: list, keys: list[RecordKey]) -> Any:
        """One batch of a block (``CHUNKS``): ``collate_fn`` (or the default collation) on
        ``samples``, then ``batch_fn`` if there is one, its ``batch_rng()`` and the global
        generators (``scope.collating``) seeded from the chunk's first record."""
        scope.collating(epoch, keys[0])
        try:
            batch = collate_privately(spec.collate_fn, samples, keys)
        except Exception as exc:
            add_note(exc, f"procpipe: raised while collating {self._records(keys)}.")
            raise
        if spec.batch_fn is None:
            return batch
        return run_batch_fn(spec, epoch, keys[0], batch, self._records(keys))

    def _records(self, keys: list[RecordKey]) -> str:
        """``keys`` (records of one shard, in order) for a message: "records 4-7 of shard 2 (name)"."""
        shard = keys[0][0]
        return f"records {keys[0][1]}-{keys[-1][1]} of shard {shard} ({self.name(shard)})"

    def describe(self, key: RecordKey) -> str:
        """A record, for a message: "record 3 of shard 0 (name)"."""
        return f"record {key[1]} of shard {key[0]} ({self.name(key[0])})"

    def name(self, shard: int) -> str:
        return reprlib.repr(self.shards[shard])

    def length_mismatch(self, shard: int, what: str) -> str:
        """The message of a shard that broke the ``lengths`` promise."""
        return (
            f"shard {shard} ({self.name(shard)}) {what}, but Shards(lengths=...) promised "
            f"{cast('tuple[int, ...]', self.lengths)[shard]}: the epoch cannot have the len() the loader "
            f"reported. Fix lengths[{shard}] "
            "(or leave lengths out: the loader then has no len()), or make open_fn yield the same records "
            "every time."
        )

    def worker_for(self, shard: int) -> int | None:
        """The worker (index) that should read ``shard``; None (here): the least loaded one.

        A source whose shards are bound to workers (``procpipe.torch.iterable``: one replica
        of an ``IterableDataset`` per worker) names it; the shard still moves if that worker
        is gone."""
        return None

    def reopening(self, block: Block) -> None:
        """Called before this process opens ``block``'s shard to read it from past its first
        records (their reader was in a process that died, or was passed): ``Shards`` opens
        the shard again and skips them, which is exact because ``open_fn`` yields the same
        records every time. A source whose iterators cannot be replayed raises here."""

    def _reader(self, epoch: int, block: Block, scope: SampleScope, status: Any | None) -> _Reader:
        """The shard's reader, positioned at the block's first record (opened again if need be)."""
        reader = self._readers.pop((epoch, block.shard), None)
        if reader is None or reader.position > block.first:
            if reader is not None:
                reader.close()
            if block.first > 0:
                self.reopening(block)
            scope.enter(epoch, RecordKey(block.shard, 0))
            try:
                reader = _Reader(iter(self.open_fn(self.shards[block.shard])))
            except Exception as exc:
                add_note(exc, f"procpipe: raised by open_fn opening shard {block.shard} ({self.name(block.shard)}).")
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


def _check_lengths(lengths: Iterable[int] | None, shards: int) -> tuple[int, ...] | None:
    """``Shards(lengths=...)`` as a tuple of record counts, one per shard (``ValueError`` otherwise)."""
    if lengths is None:
        return None
    if isinstance(lengths, (str, bytes)):
        raise TypeError(f"lengths must be a list of ints (records per shard), got {type(lengths).__name__}")
    try:
        lengths = tuple(lengths)
    except TypeError:
        raise TypeError(f"lengths must be a list of ints (records per shard), got {type(lengths).__name__}") from None
    if len(lengths) != shards:
        raise ValueError(f"lengths must give one record count per shard: {shards} shards, {len(lengths)} lengths")
    for i, n in enumerate(lengths):
        if not is_count(n, 0):
            raise ValueError(f"lengths[{i}] must be an int >= 0 (the records of shard {i}), got {n!r}")
    return lengths


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
        promised = None if shards.lengths is None else shards.lengths[key[0]]
        try:
            record = next(self.iterator)
        except StopIteration:
            self.done = True
            self.close()
            if promised is not None and self.position != promised:
                self.broken = True
                raise ShardLengthError(shards.length_mismatch(key[0], f"ended after {self.position} records")) from None
            return _END
        except Exception as exc:
            self.broken = True
            self.close()
            add_note(
                exc,
                f"procpipe: raised while reading record {key[1]} of shard {key[0]} ({shards.name(key[0])}), "
                "in the iterator open_fn returned.",
            )
            raise
        if promised is not None and self.position >= promised:
            self.broken = True
            self.close()
            raise ShardLengthError(shards.length_mismatch(key[0], f"yielded more than {promised} records"))
        self.position += 1
        return record

    def close(self) -> None:
        iterator, self.iterator = self.iterator, None
        close = getattr(iterator, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001, S110 - the iterator is done or broken; an error closing it changes nothing
                pass
