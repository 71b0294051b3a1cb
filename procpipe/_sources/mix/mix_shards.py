"""What a ``procpipe.Mix`` of streams becomes: a ``MixShardOrder``, a ``ShardOrder`` over the
shards of every source (_sources/resolve.py picks it; a ``Mix`` of indexed sources is planned by
_sources/mix/mixture.py's ``MixOrder``).

A mixture of streams (``procpipe.Shards``, or mixtures of them) mixes **shards**: its index
space is the concatenation of its sources' shard lists (``Mix.offsets`` count shards, since
``len(Shards)`` is its number of shards), so ``Mix.order`` gives the order in which an
epoch opens shards, each drawn from source ``k`` with probability ``weights[k]``. Everything
else is the stream's as it is: ``cycle_length`` shards open at once, read block by block in
tf.data's interleave (``_sources.stream.interleave.Interleave``), resume through ``StreamProgress``
(whose epoch order is the mixed one, rebuilt from the weights the state pins). So the cost
is per open shard (``cycle_length``), not per source.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

from ..stream import ShardOrder, Shards
from ..stream.blocks import Block
from .index_slices import leaf_streams
from .mixture import Mix, MixOrder


class OpenLeaf:
    """``open_fn`` of ``MixedShards``: shard ``(j, i)`` is shard ``i`` of the ``j``-th stream of
    the mixture (depth first), opened through that stream's own ``open_shard`` (so a ``Shards``
    subclass reads inside a mixture as it does alone); with ``tags`` (``Mix(with_source=True)``),
    each record comes as ``(k, record)``."""

    def __init__(self, leaves: list[Shards], tags: list[int] | None) -> None:
        self.leaves = leaves
        self.tags = tags

    def __call__(self, shard: tuple[int, int]) -> Iterable[Any]:
        j, i = shard
        records = self.leaves[j].open_shard(i)
        return records if self.tags is None else _tagged(self.tags[j], records)


def _tagged(k: int, records: Iterable[Any]) -> Iterator[tuple[int, Any]]:
    for record in records:
        yield k, record


class MixedShards(Shards):
    """One ``Shards`` holding every shard of every stream of a mixture (its leaves, depth first):
    shard ``(j, i)`` is shard ``i`` of leaf ``j``. Every hook a ``Shards`` subclass may override is
    its leaf's: ``open_shard`` (through ``OpenLeaf``), ``reading`` (each leaf that overrides it is
    told the epoch of every block), ``check_cache`` (every leaf is asked), ``worker_for``,
    ``reopening``, ``name`` and ``replayable`` (all leaves must be). The leaves are the loader's
    shallow copies, never the user's objects, as for a ``Shards`` read alone (``ShardProducer``)."""

    def __init__(self, leaves: list[Shards], tags: list[int] | None) -> None:
        leaves = [copy.copy(leaf) for leaf in leaves]
        for setting in ("cycle_length", "block_length"):
            values = {getattr(leaf, setting) for leaf in leaves}
            if len(values) > 1:
                raise ValueError(
                    f"Mix: the streams of a mixture are read as one interleave, so they must share "
                    f"{setting}; got {sorted(values, key=str)}: give every Shards the same {setting}"
                )
        lengths = [leaf.lengths for leaf in leaves]
        super().__init__(
            [(j, i) for j, leaf in enumerate(leaves) for i in range(len(leaf.shards))],
            OpenLeaf(leaves, tags),
            cycle_length=leaves[0].cycle_length,
            block_length=leaves[0].block_length,
            lengths=None if any(n is None for n in lengths) else [n for part in lengths for n in part or ()],
        )
        self.leaves = leaves
        self.replayable = all(leaf.replayable for leaf in leaves)
        # the leaves that want each block's epoch (a subclass's reading): a block costs per such
        # leaf, not per source of the mixture
        self.told_epoch = [leaf for leaf in leaves if type(leaf).reading is not Shards.reading]

    def _leaf(self, shard: int) -> tuple[int, Shards, int]:
        """Shard ``shard`` as (its leaf's position, the leaf, its index there)."""
        j, i = self.shards[shard]
        return j, self.leaves[j], i

    def reading(self, epoch: int) -> None:
        for leaf in self.told_epoch:
            leaf.reading(epoch)

    def check_cache(self) -> None:
        for leaf in self.leaves:
            leaf.check_cache()

    def name(self, shard: int) -> str:
        """The leaf's name for its shard, and which source of the mixture it is."""
        j, leaf, i = self._leaf(shard)
        return f"{leaf.name(i)}: the mixture's source {j}, depth first"

    def worker_for(self, shard: int) -> int | None:
        _, leaf, i = self._leaf(shard)
        return leaf.worker_for(i)

    def reopening(self, block: Block) -> None:
        _, leaf, i = self._leaf(block.shard)
        leaf.reopening(Block(i, block.number, block.first, block.length, block.skip))


def combined_shards(mix: Mix, seed: int = 0, shuffle: bool = False, reshuffle: bool = True) -> MixedShards:
    """The ``MixedShards`` of ``mix``, in the mixture's index order (an indexed source among them:
    the slices of its epoch order, ``_sources/mix/index_slices.py``, read with the loader's
    ``seed``, ``shuffle`` and ``reshuffle``)."""
    return MixedShards(leaf_streams(mix, seed, shuffle, reshuffle), mix.leaf_owners() if mix.with_source else None)


class MixShardOrder(ShardOrder):
    """A ``ShardOrder`` whose epochs open shards in a mixture's order (``MixOrder.mixed_order``
    over the shards), then ``shard=(rank, world)``: positions ``rank, rank + world, ...`` of it,
    as for any stream. ``mixing`` keeps each epoch's weights (saved in, and pinned by, states)."""

    def __init__(self, mix: Mix, **options: Any) -> None:
        seed, shuffle, reshuffle = int(options["seed"]), bool(options["shuffle"]), bool(options.get("reshuffle", True))
        shards = combined_shards(mix, seed, shuffle, reshuffle)
        super().__init__(shards, **options)
        shard = None if self.shard is None else (self.shard[0], self.shard[1])
        self.mixing = MixOrder(len(mix), None, self.shuffle, self.seed, False, shard, self.reshuffle, mix=mix)

    def batches(self, epoch: int) -> list[int]:
        """The shards of ``epoch`` (indices into the combined shards), in the order they are opened."""
        order = self.mixing.mixed_order(epoch)
        if self.shard is None:
            return order.tolist()
        mine = order[self.shard[0] :: self.shard[1]].tolist()
        limits = self.limits(epoch)  # even_ranks: cut from the mixed order, as every rank's
        return mine if limits is None else limits.order(mine)

    def full_order(self, epoch: int) -> Any:
        """The mixed order of ``epoch``'s shards, before sharding (what ``even_ranks`` counts)."""
        return self.mixing.mixed_order(epoch, record=False)

    def __len__(self) -> int:
        """Batches of an epoch reading every shard (an upper bound with ``stop_on_empty`` or a
        weight 0), from ``Shards(lengths=...)``; ``TypeError`` without them, or with ``shard``."""
        if self.shards.lengths is None or self.shard is not None:
            raise TypeError(
                "a Loader over a mixture of streams has a len() only with every Shards' lengths=... "
                "and without shard=(rank, world_size) (each rank's shards, hence records, differ)"
            )
        return self.batch_count(list(range(len(self.shards.shards))))

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), **self.mixing.settings()}
