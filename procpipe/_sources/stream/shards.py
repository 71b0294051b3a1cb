"""The streaming source, as the user gives it: ``Shards`` (its tasks, ``Block`` and ``RecordKey``,
are in blocks.py; reading them, in any process, is shard_producer.py's ``ShardProducer``).

Where it sits in the data path: the user passes a ``Shards`` as the Loader's source; it is a
spec only, never changed by a loader. ``ShardOrder`` (shard_order.py) decides the block length
and how a worker lays a block out, and builds the workers' producer (``ShardProducer``: a copy
of the Shards, the layout, the shards open in this process), which its kind (stream_kind.py)
puts in ``WorkerSpec.producer``. The producer reads every shard through ``open_shard`` and says
each block's epoch with ``reading``: the hooks a subclass overrides (``procpipe.torch``'s
``Replicas``, a ``Mix``'s ``MixedShards`` and ``SliceShards``), beside ``worker_for``, ``reopening`` and ``replayable``.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from ..._core.checks import check_int, is_count

if TYPE_CHECKING:
    from .blocks import Block, RecordKey


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

    # ------------------------------------------------------------------ hooks (read in the workers)
    def open_shard(self, shard: int) -> Iterable[Any]:
        """The records of shard ``shard`` (an index into ``shards``), from its start: every read
        of a shard goes through here (``ShardProducer``), in the process that reads it.
        Default: ``open_fn(shards[shard])``."""
        return self.open_fn(self.shards[shard])

    def reading(self, epoch: int) -> None:
        """Called in the reading thread before each block is read, with the block's epoch
        (before ``open_shard``, if its shard is opened). Default: nothing; a subclass whose
        records depend on the epoch keeps it here. The loader's copy of this object is the
        one called (``ShardProducer`` holds a ``copy.copy``), never the user's: the copy is
        shallow, so keep per-process state in attributes set here, not in a container the
        user's object shares."""

    def check_cache(self) -> None:
        """Called before a loader lays out a cache of this source's records (``cache=...``):
        raise (a ``ValueError`` saying why) if they cannot be cached. Default: nothing."""

    def describe(self, key: RecordKey) -> str:
        """A record, for a message: "record 3 of shard 0 (name)"."""
        return f"record {key[1]} of shard {key[0]} ({self.name(key[0])})"

    def name(self, shard: int) -> str:
        """Shard ``shard`` for a message (its entry of ``shards``, shortened)."""
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
