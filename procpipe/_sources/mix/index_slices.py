"""Reading an indexed dataset as shards, in a mixture with streams (``Mix([dataset, Shards(...)])``).

Why: a mixture holding a stream is a stream (``_sources/mix/mix_shards.py``: one ``Shards`` of every
source's shards, opened in the mixed order), so an indexed dataset in it must be shards too.
Its shard ``v`` (of ``_sources.mix.slice_sizes.virtual_shards``) is the slice ``v * size .. (v + 1) *
size - 1`` of the dataset's **epoch order**: a permutation from ``(seed, epoch)`` and the
source's position with ``shuffle=True`` (``epoch`` 0's every epoch with ``reshuffle=False``),
else ``0, 1, ...``. So its elements are shuffled across the whole dataset each epoch, not only
within a slice, and each comes exactly once per epoch (the slices partition the order).

A shard's records depend on the epoch, which ``open_fn(shard)`` is not given: the source's
``SliceShards`` says it, in the reading thread, before each block is read (its ``reading`` hook,
called through the mixture's ``MixedShards`` by ``ShardProducer.produce_block``), and
``IndexSlices`` reads it there. The epoch's permutation is computed once per process and epoch
(the last two are kept: with ``epochs=N`` the next epoch begins before this one ends).
``cache=`` is refused: a shard's records change from epoch to epoch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from ..stream import Shards
from .mixture import Mix, is_stream
from .slice_sizes import virtual_shards

_SLICES_KEY = 0x4D6958  # spawn-key prefix of the slices' permutations ("MiX"), apart from Mix's own keys
_reading = threading.local()  # .epoch: the epoch of the block this thread is reading

__all__ = ["IndexSlices", "SliceShards", "leaf_streams"]


class IndexSlices:
    """``open_fn`` of an indexed dataset read as shards: shard ``v`` yields
    ``dataset[order[v * size]], ...`` for the slice ``v`` of the epoch's order."""

    def __init__(self, dataset: Any, size: int, leaf: int, seed: int, shuffle: bool, reshuffle: bool) -> None:
        self.dataset = dataset
        self.size = size
        self.leaf = leaf  # the source's position among the mixture's leaves: each source its own permutation
        self.seed = seed
        self.shuffle = shuffle
        self.reshuffle = reshuffle
        self._orders: dict[int, np.ndarray] = {}  # epoch -> this process's copy of its permutation

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_orders": {}}

    def order(self, epoch: int) -> np.ndarray:
        """The dataset's order in ``epoch`` (the slices are its parts)."""
        key = epoch if self.reshuffle else 0
        order = self._orders.get(key)
        if order is None:
            n = len(self.dataset)
            if self.shuffle:
                sequence = np.random.SeedSequence(self.seed, spawn_key=(_SLICES_KEY, key, self.leaf))
                order = np.random.Generator(np.random.PCG64(sequence)).permutation(n)
            else:
                order = np.arange(n)
            for old in sorted(self._orders)[:-1]:
                del self._orders[old]
            self._orders[key] = order
        return order

    def __call__(self, shard: int) -> Iterator[Any]:
        epoch = getattr(_reading, "epoch", None)
        if epoch is None:
            raise RuntimeError(
                "an indexed source of a procpipe.Mix with streams is read by procpipe.Loader only "
                "(its shards are slices of each epoch's order)"
            )
        indices = self.order(epoch)[shard * self.size : (shard + 1) * self.size].tolist()  # (now: the epoch is now's)
        return _elements(self.dataset, indices)

    def lengths(self) -> list[int]:
        """Each slice's element count (the last one may be shorter)."""
        n, size = len(self.dataset), self.size
        return [min(size, n - v * size) for v in range(virtual_shards(n, size))]


def _elements(dataset: Any, indices: list[int]) -> Iterator[Any]:
    for index in indices:
        yield dataset[index]


class SliceShards(Shards):
    """The ``Shards`` of an indexed source in a mixture with streams: its shards are the slices
    of each epoch's order (``IndexSlices``), told the epoch of each block before it is read
    (``reading``); ``cache=`` is refused."""

    def reading(self, epoch: int) -> None:
        _reading.epoch = epoch  # (in this thread: the slices opened for the block read it)

    def name(self, shard: int) -> str:
        """A slice, named with the dataset it is cut from."""
        kind = type(cast(IndexSlices, self.open_fn).dataset).__name__
        return f"slice {shard} of the epoch order of the indexed {kind}"

    def check_cache(self) -> None:
        raise _no_cache()


def _no_cache() -> ValueError:
    return ValueError(
        "cache=... is not supported for a procpipe.Mix of indexed datasets and streams: an indexed "
        "dataset is read there as shards whose records change every epoch (slices of its shuffled "
        "order), so a record's place in the cache would hold other data the next epoch; cache inside "
        "the dataset's __getitem__ instead, or leave cache out"
    )


def leaf_streams(mix: Mix, seed: int, shuffle: bool, reshuffle: bool) -> list[Shards]:
    """``Mix.leaves()`` as streams, depth first: a ``Shards`` as it is, an indexed dataset as the
    ``Shards`` of its slices (with the first stream's ``cycle_length`` and ``block_length``:
    they are read in one interleave)."""
    pairs: list[tuple[Any, int | None]] = [
        (source, None if is_stream(source) else parent.shard_size)
        for source, parent in zip(mix.leaves(), mix.leaf_parents(), strict=True)
    ]
    first = next(source for source, size in pairs if size is None)
    out: list[Shards] = []
    for leaf, (source, size) in enumerate(pairs):
        if size is None:
            out.append(source)
            continue
        slices = IndexSlices(source, size, leaf, seed, shuffle, reshuffle)
        lengths = slices.lengths()
        out.append(
            SliceShards(
                list(range(len(lengths))),
                slices,
                cycle_length=first.cycle_length,
                block_length=first.block_length,
                lengths=lengths,
            )
        )
    return out
