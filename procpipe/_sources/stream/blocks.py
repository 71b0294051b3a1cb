"""A stream's units of work and identity: ``RecordKey``, ``Block``, and a block's reply layout.

``RecordKey`` names a record (``(shard, record)``, the streaming counterpart of an index);
``Block`` is the task a worker reads (a run of records of one shard, shard_plan.py offers
them); ``BlockRead`` and ``block_layout`` are what reading one found, sent back with the
records' layout. Apart from ``Shards`` (shards.py), which reads blocks, so that the plan and
batching modules need not import the reading code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..._core.tree import INLINE, SEQ

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; typing_extensions is read by type checkers only


class RecordKey(tuple):
    """``(shard, record)``: a record's identity, the streaming counterpart of an index.

    ``shard`` is the shard's position in ``Shards.shards`` (not in the epoch's shuffled
    order), ``record`` its number within the shard. ``sample_rng()`` is seeded from
    ``(seed, epoch, shard, record)``; error messages name records by it.
    """

    __slots__ = ()

    def __new__(cls, shard: int, record: int) -> Self:
        return tuple.__new__(cls, (shard, record))

    def __getnewargs__(self) -> tuple[int, int]:
        return tuple(self)

    def __repr__(self) -> str:
        return f"(shard {self[0]}, record {self[1]})"


class BlockRead(NamedTuple):
    """What reading one block found: sent with the block's layout (``block_layout``)."""

    read: int  # records read from the shard (fewer than block_length: the shard ended)
    kept: int  # records the block holds (read, less those received before a resume)
    failed: tuple  # records on_error="skip" left out


def block_layout(info: BlockRead, inner: list) -> list:
    """A block's reply layout (collate.py's format): ``info`` travels inline beside the layout
    of its records, so the coordinator learns both from the one reply."""
    return [SEQ, tuple, [[INLINE, tuple(info)], inner]]


def split_block_layout(layout: list) -> tuple[BlockRead, list]:
    """``block_layout``'s inverse: the ``BlockRead`` and the records' own layout."""
    info, inner = layout[2]
    return BlockRead(*info[1]), inner


class Block:
    """A task: records ``first .. first + length - 1`` of shard ``shard`` (its block ``number``).

    Sent to a worker in place of a list of indices. Iterating it gives the keys of the
    records it may hold (for the coordinator's messages about lost or stuck tasks).
    ``skip``: ``(start, stop)`` ranges of its records the consumer received before a
    resume; the worker reads past them (the shard's iterator only, not ``fn``) and leaves
    them out of the block's layout.
    """

    __slots__ = ("first", "length", "number", "shard", "skip")

    def __init__(
        self, shard: int, number: int, first: int, length: int, skip: tuple[tuple[int, int], ...] = ()
    ) -> None:
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
        return f"block {self.number} of shard {self.shard} (records {self.first}-{self.first + self.length - 1})"
