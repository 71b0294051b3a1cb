"""The workers' side of a streaming source: ``ShardProducer``, which reads a ``Shards``' blocks
in any process.

Where it sits in the data path: ``ShardOrder`` (shard_order.py) builds it once per loader from
the user's ``Shards`` (shards.py): it holds a ``copy.copy`` of them (so a subclass's per-process
state stays out of the user's object), the block layout (``STACK``, ``CHUNKS`` or ``RECORDS``),
the shards open in this process and the cache's offsets; its kind (stream_kind.py) puts it in
``WorkerSpec.producer``, shipped to every worker. The coordinator sends each worker ``Block``
tasks (shard_plan.py); in the worker (or in the calling process with ``workers=0``)
``produce.produce`` hands a block to ``ShardProducer.produce_block``, which says its epoch
(``Shards.reading``), reads its records from the shard's iterator (``OpenShard``, opened by
``Shards.open_shard`` and kept open between blocks: shard affinity), runs each through the one
per-sample pipeline (_worker/stages.py: the cache or ``fn``, ``augment``, skip on error) under
its sample scope (seeded from its ``RecordKey``), and collates them into the task's ring slot.
Turning blocks into batches is block_batching.py's, in the loader's process.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

from ..._core import collate
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
    from ..._worker.worker_spec import SampleCache
    from .shards import Shards

# How a worker lays out a block (``ShardProducer.mode``), chosen by ``ShardOrder`` (saved in states as ``mode``):
STACK = "stack"  # default collation: one stacked batch of the block's records (cut/joined by Output)
CHUNKS = "chunks"  # collate_fn or batch_fn: the block's records in chunks of batch_size, each chunk a batch
RECORDS = "records"  # batch_size=None or shuffle_buffer: every record laid out on its own
_EXTRA_OPEN = 8  # open iterators a worker keeps beyond 2 * cycle_length (LRU)
_END = object()  # an open shard's end


class ShardProducer:
    """The workers' producer of a ``Shards`` (_worker/worker_spec.py ``Producer``): reads blocks.

    Holds a copy of ``shards`` (taken here, once per loader: the user's object is never
    changed), how a block is laid out (``block_length``, ``mode``, ``batch_size``), this
    process's open shards (``OpenShard``, an LRU: shard affinity) and the cache's offsets.
    Pickled (shipped to the workers) without its open shards.
    """

    def __init__(self, shards: Shards, block_length: int, mode: str, batch_size: int | None) -> None:
        self.shards = copy.copy(shards)  # (the loader's own: a subclass may keep per-process state in it)
        self.block_length = block_length
        self.mode = mode
        self.batch_size = batch_size
        self._offsets: list[int] | None = None  # cache=...: each shard's first cache index (cache_index)
        self._open: OrderedDict[tuple[int, int], OpenShard] = OrderedDict()  # this process's open shards

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()  # open iterators stay in the process that opened them
        return state

    def __repr__(self) -> str:
        return f"ShardProducer({self.shards!r}, block_length={self.block_length}, mode={self.mode!r})"

    # ------------------------------------------------------------------ reading (any process)
    @property
    def cache_kind(self) -> CacheKind:
        """The producer's cache layout (_worker/worker_spec.py ``Producer``): per record, or growing (no lengths)."""
        return GROWING if self.shards.lengths is None else PER_RECORD

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
        mode, batch_size = self.mode, self.batch_size
        self.shards.reading(epoch)
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
        reader = self._opened(epoch, block, scope, status)
        stop = block.first + block.length
        try:
            while reader.position < stop:
                key = RecordKey(block.shard, reader.position)
                scope.enter(epoch, key)  # the iterator's own draws and fn's share this record's generator
                if status is not None:
                    status[1] = reader.position
                record = reader.next(self.shards, key)
                if record is _END:
                    break
                if block.skip and block.skipped(key[1]):
                    continue
                index = key if cache is None else self.cache_index(key)
                record = run_sample(spec, scope, index, {index: record}, key, skipped, self.shards.describe)
                if record is not SKIPPED:
                    keys.append(key)
                    samples.append(record)
        finally:
            self._keep(epoch, block.shard, reader)
        if reader.done and self.shards.lengths is None and cache is not None:
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
        known = self.shards.lengths[block.shard] if self.shards.lengths is not None else cache.shard_end(block.shard)
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
                sample = run_sample(spec, scope, key, None, key, skipped, self.shards.describe, cached)
                if sample is not SKIPPED:
                    keys.append(key)
                    samples.append(sample)
            scope.leave()
        return keys, samples, max(0, end - block.first)

    # ------------------------------------------------------------------ the cache (cache=...)
    def cache_length(self) -> int:
        """Records in all shards: the cache's length (``ValueError`` without ``lengths``)."""
        self.shards.check_cache()
        if self.shards.lengths is None:
            raise ValueError(
                "cache=... with a streaming source needs the shards' record counts, to lay the cache "
                "file out: pass Shards(..., lengths=[records of each shard])"
            )
        return sum(self.shards.lengths)

    def cache_index(self, key: RecordKey) -> int | RecordKey:
        """The cache's index of record ``(shard, record)``: the records of the shards before it, plus ``record``;
        the key itself without ``lengths`` (the cache then grows as records arrive: _worker/stream_cache.py)."""
        if self.shards.lengths is None:
            return key
        if self._offsets is None:
            self._offsets = [0]
            for n in self.shards.lengths:
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
        self.shards.check_cache()
        for shard in range(len(self.shards.shards)):
            if self.shards.lengths is not None and not self.shards.lengths[shard]:
                continue
            key = RecordKey(shard, 0)
            scope.enter(0, key)
            try:
                reader = OpenShard(iter(self.shards.open_shard(shard)))
                record = reader.next(self.shards, key)
                reader.close()
            except Exception as exc:
                add_note(
                    exc,
                    f"procpipe: raised in the calling process while reading record 0 of shard {shard} "
                    f"({self.shards.name(shard)}) to lay out the cache (cache=...).",
                )
                raise
            finally:
                scope.leave()
            if record is _END and self.shards.lengths is None:
                continue
            if record is _END:
                raise ShardLengthError(self.shards.length_mismatch(shard, "ended after 0 records"))
            return self.cache_index(key), key, record
        if self.shards.lengths is None:
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
        return f"records {keys[0][1]}-{keys[-1][1]} of shard {shard} ({self.shards.name(shard)})"

    def _opened(self, epoch: int, block: Block, scope: SampleScope, status: Any | None) -> OpenShard:
        """The shard's reader, positioned at the block's first record (opened again if need be)."""
        reader = self._open.pop((epoch, block.shard), None)
        if reader is None or reader.position > block.first:
            if reader is not None:
                reader.close()
            if block.first > 0:
                self.shards.reopening(block)
            scope.enter(epoch, RecordKey(block.shard, 0))
            try:
                reader = OpenShard(iter(self.shards.open_shard(block.shard)))
            except Exception as exc:
                add_note(
                    exc, f"procpipe: raised by open_fn opening shard {block.shard} ({self.shards.name(block.shard)})."
                )
                raise
        try:
            while reader.position < block.first:  # a reopened shard: skip what earlier blocks had
                key = RecordKey(block.shard, reader.position)
                scope.enter(epoch, key)
                if status is not None:
                    status[1] = reader.position
                if reader.next(self.shards, key) is _END:
                    break
        except BaseException:
            reader.close()
            raise
        return reader

    def _keep(self, epoch: int, shard: int, reader: OpenShard) -> None:
        if reader.broken:
            return
        readers = self._open
        readers[(epoch, shard)] = reader
        limit = 2 * self.shards.cycle_length + _EXTRA_OPEN
        while len(readers) > limit:
            _, old = readers.popitem(last=False)
            old.close()

    def close_readers(self) -> None:
        """Close every shard this process has open (``workers=0``: when an epoch is abandoned)."""
        readers, self._open = self._open, OrderedDict()
        for reader in readers.values():
            reader.close()


class OpenShard:
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
