"""An epoch's order: ``range(n)`` permuted from ``(seed, epoch)`` and sharded by rank, the one
definition for the samples of an indexed source (``indexed/index_order.py``) and the shards of a
stream (``stream/shard_order.py``); and the orders a combined state gives (``GivenOrders``).
The order depends only on ``(seed, epoch)``: the worker path and ``workers=0`` see the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.rng import shuffle_rng


def epoch_order(
    n: int,
    epoch: int,
    shuffle: bool,
    seed: int,
    reshuffle: bool,
    shard: tuple[int, int] | None,
    pad_to: int | None = None,
) -> np.ndarray:
    """The one definition of an epoch's order, for samples (``IndexOrder``) and for shards
    (``_sources.stream.ShardOrder``): ``range(n)``, permuted from ``(seed, epoch)`` (epoch 0's
    permutation every epoch without ``reshuffle``), then this rank's part with
    ``shard=(rank, world)``: positions ``rank, rank + world, ...``, after padding the order
    to ``pad_to`` by repeating its first entries (``DistributedSampler``'s equal lengths)."""
    order = shuffle_rng(seed, epoch if reshuffle else 0).permutation(n) if shuffle else np.arange(n)
    if shard is not None:
        rank, world = shard
        if pad_to is not None:
            order = np.resize(order, pad_to)  # resize pads by repeating
        order = order[rank::world]
    return order


class GivenOrders:
    """The epoch whose order is given, not drawn: what loading a state from ``procpipe.combine_states``
    installs in an ``IndexOrder`` or ``MixOrder`` (_sources/combine.py): the indices no rank of the saved
    run had delivered, this rank's part of them, and the combined state it came from (``base``,
    kept for the states this loader saves in that epoch). One epoch at most."""

    __slots__ = ("_base", "_epoch", "_order")

    def __init__(self) -> None:
        self._epoch: int | None = None
        self._order: np.ndarray | None = None
        self._base: Any = None

    def give(self, epoch: int, order: np.ndarray, base: Any) -> None:
        """``epoch``'s order is ``order`` (from the combined state ``base``), in place of any given before."""
        self._epoch, self._order, self._base = epoch, order, base

    def forget(self) -> None:
        """A plain state is loaded: every epoch's order is drawn again."""
        self._epoch, self._order, self._base = None, None, None

    def order(self, epoch: int) -> np.ndarray | None:
        """The order given for ``epoch``, or None (drawn as usual)."""
        return self._order if epoch == self._epoch else None

    def base(self, epoch: int) -> Any:
        """The combined state ``epoch``'s order came from, or None."""
        return self._base if epoch == self._epoch else None

    def __repr__(self) -> str:
        return f"GivenOrders(epoch={self._epoch})"


__all__ = ["GivenOrders", "epoch_order"]
