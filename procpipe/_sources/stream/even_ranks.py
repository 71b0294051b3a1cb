"""``Loader(shard=(rank, world_size), even_ranks=True)`` for a stream: every rank the same number of batches.

Why: a streaming source is sharded by whole shards (rank ``r`` reads shards ``r, r + w, ...``
of each epoch's order), so ranks get different numbers of records when shards differ in
length, and distributed training hangs in a collective when one rank runs out of batches
before the others (pytorch#141069). ``DistributedSampler`` pads an indexed source; a
stream cannot pad without reading records twice.

The policy is **drop**: with the shards' record counts known (``Shards(lengths=...)``), each
epoch every rank reads exactly ``R`` records, ``R`` the smallest record count of any rank in
that epoch; a rank with more leaves out the last records of its epoch's shard order (the
shards it opens last are cut short, or not read at all). Equal records give equal batches
(``ceil(R / batch_size)``, or ``floor`` with ``drop_last``) where batches may span blocks:
the default collation, ``batch_size=None`` and ``shuffle_buffer``. With ``collate_fn`` or
``batch_fn`` a batch never spans blocks (``Chunking``), so the unit made equal is the batch:
each rank reads the records of ``B`` batches, ``B`` the fewest of any rank. Which records
are left out is decided from ``(seed, epoch)`` alone, so it is the same on every run and
resume; with ``reshuffle`` the shards move between ranks every epoch, so different records
are left out each epoch.

Pure: no process, thread or clock. ``RankLimits`` is computed once per epoch by the
``ShardOrder`` (shard_order.py); ``ShardPlan`` cuts its blocks with ``block_length_at``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Chunking:
    """How many batches ``n`` records of one shard make when batches never span blocks
    (``collate_fn`` or ``batch_fn``: each block is cut into chunks of ``batch_size``), and
    the fewest records that make ``k`` of them."""

    def __init__(self, block_length: int, batch_size: int, drop_last: bool) -> None:
        self.block, self.size, self.drop_last = block_length, batch_size, drop_last
        self.per_block = self._partial(block_length)

    def _partial(self, records: int) -> int:
        return records // self.size if self.drop_last else -(-records // self.size)

    def batches(self, records: int) -> int:
        return records // self.block * self.per_block + self._partial(records % self.block)

    def records_for(self, batches: int) -> int:
        """Records of a shard's start that give exactly ``batches`` batches (fewer than its length)."""
        return batches // self.per_block * self.block + batches % self.per_block * self.size


class RankLimits:
    """One epoch's cut for one rank: ``records`` (R: the same on every rank, in batches with
    ``chunking``) and, per shard of the rank's order, how many of its records are read
    (``limits``; a shard with 0 is not read)."""

    __slots__ = ("limits", "records", "totals")

    def __init__(
        self, lengths: Sequence[int], order: np.ndarray, world: int, rank: int, chunking: Chunking | None = None
    ) -> None:
        """``order``: the epoch's whole shard order, before sharding (rank ``r`` reads ``order[r::world]``).
        ``chunking``: batches never span blocks, so the unit that must be equal is the batch."""
        unit = (lambda n: n) if chunking is None else chunking.batches
        counts = [unit(lengths[s]) for s in order.tolist()]
        self.totals = [sum(counts[r::world]) for r in range(world)]  # records (or batches) of each rank, uncut
        self.records = min(self.totals)
        self.limits: dict[int, int] = {}
        left = self.records
        for shard, count in zip(order[rank::world].tolist(), counts[rank::world], strict=True):
            take = min(count, left)
            if chunking is None or take == count:
                self.limits[shard] = lengths[shard] if take == count else take
            else:
                self.limits[shard] = chunking.records_for(take)
            left -= take

    def order(self, order: list[int]) -> list[int]:
        """``order`` less the shards this rank does not read at all."""
        return [shard for shard in order if self.limits.get(shard, 0) > 0]

    def block_length_at(self, shard: int, first: int, block_length: int) -> int:
        """The records of the block of ``shard`` starting at record ``first`` (fewer than
        ``block_length`` where the cut falls: the shard then ends there, as at its real end)."""
        return max(0, min(block_length, self.limits.get(shard, 0) - first))


def even_ranks_unsupported(even_ranks: bool, shards: object) -> list:
    """``(bad, what)`` pairs for ``ShardOrder``'s checks of ``even_ranks=True``."""
    if not even_ranks:
        return []
    return [
        (
            getattr(shards, "lengths", None) is None,
            "even_ranks=True without the shards' record counts (every rank's records are counted from them): pass "
            "Shards(..., lengths=[records of each shard])",
        ),
    ]
