"""Blocks into batches, in the loader's process: ``Output`` and its row/join helpers.

Where it sits in the data path: each ``ShardPlan`` (shard_plan.py) has an ``Output``, to
which it hands the blocks the coordinator received from the workers, in the order they
are used (the interleave's when ordered). ``Output`` cuts and joins them into what the
consumer gets, each item with the record ranges it covers (for ``StreamProgress``,
interleave.py), which go into the iteration's queue. A batch inside one block is a zero-copy
view of its ring slot; one spanning blocks is joined here (``_join``); the shuffle
buffer copies its records out of their slots (``_own``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ..._core import collate
from ..._core.rng import buffer_rng
from ..._core.tree import ARRAY, DICT, INLINE, SEQ
from ..._worker.produce import collate_privately
from ...errors import CollateError
from .blocks import Block, RecordKey
from .shard_producer import CHUNKS, STACK


@dataclass(frozen=True)
class BatchingConfig:
    """The settings ``Output`` batches with, fixed for a loader (``ShardOrder.batching`` builds
    it once; a plain record of settings, so batching needs nothing from the plan above it)."""

    mode: str  # shards.STACK, CHUNKS or RECORDS
    batch_size: int | None
    drop_last: bool
    collate_fn: Callable | None
    shuffle_buffer: int | None  # records in the shuffle buffer; None: no shuffle buffer
    seed: int  # with shuffle_buffer: the buffer's draws come from (seed, epoch)


class Output:
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

    def __init__(self, config: BatchingConfig, epoch: int) -> None:
        self.mode = config.mode
        self.batch_size = config.batch_size
        self.drop_last = config.drop_last
        self.collate_fn = config.collate_fn
        self.capacity = config.shuffle_buffer
        self.parts: deque[list] = deque()  # STACK: [layout, lease, start row, stop row, shard, records] not yet batched
        self.pending = 0
        self.dropped: list[tuple[int, int, int]] = []  # records drop_last left out since the last item
        self.buffer: list[tuple[RecordKey, Any]] = []  # shuffle buffer
        self.batch: list[tuple[RecordKey, Any]] = []  # records out of the buffer, not yet a batch
        self.rng = buffer_rng(config.seed, epoch) if config.shuffle_buffer is not None else None
        self.draws = np.empty(0)
        self.drawn = 0

    def add(self, block: Block, records: range | list[int], inner: list, lease: Any) -> list[tuple[Any, int, list]]:
        """A block's layout ``inner`` holding ``records`` (record numbers in its shard): the items it completes."""
        shard = block.shard
        out: list[tuple[Any, int, list]] = []
        if (capacity := self.capacity) is not None:
            for record, node in zip(records, inner[2], strict=False):
                self._shuffled((RecordKey(shard, record), _own(collate.build(node, lease))), out, capacity)
        elif self.mode == STACK:
            self.parts.append([inner, lease, 0, len(records), shard, records])
            self.pending += len(records)
            size = cast(int, self.batch_size)  # (STACK and CHUNKS batch a fixed number of records)
            while self.pending >= size:
                self._item(*self._take(size), size, out)
        elif self.mode == CHUNKS:
            size = cast(int, self.batch_size)
            for i, node in enumerate(inner[2]):
                chunk = _spans(shard, records[i * size : (i + 1) * size])
                if len(records) - i * size >= size or not self.drop_last:
                    self._item(collate.build(node, lease), chunk, min(size, len(records) - i * size), out)
                else:
                    self.dropped += chunk
        else:
            for record, node in zip(records, inner[2], strict=False):
                self._item(collate.build(node, lease), [(shard, record, record + 1)], 1, out)
        return out

    def left_out(self, shard: int, records: tuple[int, ...]) -> None:
        """Records ``on_error="skip"`` left out: covered by the next item, as if received (a resume
        does not try them again)."""
        self.dropped += _spans(shard, sorted(records))

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
            return collate.build(_rows(layout, start, start + n), lease), _spans(shard, records[start : start + n])
        pieces, coverage = [], []
        while n:
            part = parts[0]
            k = min(n, part[3] - part[2])
            pieces.append((part[0], part[1], part[2], part[2] + k))
            coverage += _spans(part[4], part[5][part[2] : part[2] + k])
            part[2] += k
            n -= k
            if part[2] == part[3]:
                parts.popleft()
        return collate.build(_join(pieces, ()), None), coverage

    # -- shuffle buffer --------------------------------------------------------------
    def _draw(self, n: int) -> int:
        if self.drawn == len(self.draws):
            self.draws = cast(np.random.Generator, self.rng).random(1024)  # (set with a shuffle buffer)
            self.drawn = 0
        u = self.draws[self.drawn]
        self.drawn += 1
        return int(u * n)

    def _shuffled(self, record: tuple, out: list, capacity: int) -> None:
        buffer = self.buffer
        if len(buffer) < capacity:
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
        return [ARRAY, node[1], (stop - start,) + shape[1:], node[3] + start * row, *node[4:]]
    if kind == INLINE:
        return [INLINE, node[1][start:stop]]
    return [kind, node[1], [_rows(child, start, stop) for child in node[2]]]


def _join(pieces: list[tuple[list, Any, int, int]], path: tuple) -> list:
    """One layout (arrays inline, copied) of consecutive record ranges of several stacked blocks."""
    nodes = [p[0] for p in pieces]
    first = nodes[0]
    if first[0] in (ARRAY, INLINE):
        values = [collate.build(_rows(node, a, b), lease) for node, lease, a, b in pieces]
        tensor = collate.tensor_type()  # a block of tensors means torch is imported
        if tensor is not None and all(isinstance(v, tensor) for v in values):
            return [INLINE, _join_tensors(values, path)]
        if all(isinstance(v, np.ndarray) for v in values):
            kinds = {(v.dtype, v.shape[1:]) for v in values}  # the dtype itself: .str drops a structure's fields
            if len(kinds) > 1:
                raise _join_error(
                    path,
                    "arrays of " + " and ".join(f"shape {('N',) + s} dtype {d}" for d, s in sorted(kinds, key=str)),
                )
            return [INLINE, np.concatenate(values, dtype=values[0].dtype)]  # as produced: not native byte order
        if all(isinstance(v, list) for v in values):
            return [INLINE, [x for v in values for x in v]]
        raise _join_error(path, "numbers in one block and other objects in another")
    if any(node[0] != first[0] for node in nodes):
        raise _join_error(path, "a mapping in one block and a sequence in another")
    if first[0] == DICT:
        keys = first[1]
        children = []
        for key in keys:
            column = []
            for node, lease, a, b in pieces:
                if set(node[1]) != set(keys):
                    raise _join_error(path, f"keys {sorted(map(str, keys))} and {sorted(map(str, node[1]))}")
                column.append((node[2][list(node[1]).index(key)], lease, a, b))
            children.append(_join(column, path + (key,)))
        return [DICT, keys, children]
    if any(node[1] is not first[1] or len(node[2]) != len(first[2]) for node in nodes):
        raise _join_error(path, "sequences of different types or lengths")
    return [
        SEQ,
        first[1],
        [_join([(node[2][i], lease, a, b) for node, lease, a, b in pieces], path + (i,)) for i in range(len(first[2]))],
    ]


def _join_tensors(values: list, path: tuple) -> Any:
    """Stacked torch tensors of several blocks as one tensor (joined through numpy views,
    as collation stacks them: dtypes numpy lacks travel as same-width integers)."""
    from ..._core.tensors import numpy_tensor, tensor_numpy

    arrays = [tensor_numpy(v) for v in values]
    kinds = {(v.dtype, v.shape[1:]) for v in values}
    if len(kinds) > 1:
        raise _join_error(
            path,
            "tensors of " + " and ".join(f"shape {('N',) + tuple(s)} dtype {d}" for d, s in sorted(kinds, key=str)),
        )
    joined = np.concatenate([a for a, _ in arrays], dtype=arrays[0][0].dtype)
    return numpy_tensor(joined, arrays[0][1])


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
