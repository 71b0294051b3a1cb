"""Which indices each batch of an epoch holds.

The order depends only on ``(seed, epoch)``; batches are consecutive slices of it. This
is the single source of truth for both the worker path and the ``workers=0`` path.

Anything with ``batches(epoch) -> list[list[int]]`` and ``__len__`` can stand in for
``Sampler``: ``ExplicitBatches`` wraps a caller's ``batches=`` callable (used by
``procpipe.torch.DataLoader`` to follow a torch sampler).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .._core.rng import shuffle_rng
from .index import IndexPlan


def epoch_order(
    n: int,
    epoch: int,
    shuffle: bool,
    seed: int,
    reshuffle: bool,
    shard: tuple[int, int] | None,
    pad_to: int | None = None,
) -> np.ndarray:
    """The one definition of an epoch's order, for samples (``Sampler``) and for shards
    (``_streaming.StreamPlan``): ``range(n)``, permuted from ``(seed, epoch)`` (epoch 0's
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
    installs in a ``Sampler`` or ``MixSampler`` (_consumer/elastic.py): the indices no rank of the saved
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


@dataclass(frozen=True)
class Sampler:
    """Splits ``range(length)`` into the batches of each epoch.

    ``batch_size=None`` means one sample per batch (yielded unbatched).
    ``shard=(rank, world_size)`` keeps this rank's part of every epoch's order, as
    ``torch.utils.data.DistributedSampler`` does: the order is padded by repeating its
    first indices to a multiple of ``world_size``, then rank ``r`` takes positions
    ``r, r + world_size, ...``. Every rank has the same length; together they see
    every index once per epoch (plus the padding).
    ``reshuffle=False`` keeps one order: every epoch uses epoch 0's permutation (the
    per-sample random generators still differ by epoch).
    ``given``: epochs whose order is given, not computed (``GivenOrders``: set when a state
    from ``procpipe.combine_states`` is loaded).
    """

    plan_class: ClassVar[type[IndexPlan]] = IndexPlan  # each epoch: a fixed list of batches (_plan/index.py)

    length: int
    batch_size: int | None
    shuffle: bool
    seed: int
    drop_last: bool
    shard: tuple[int, int] | None = None
    reshuffle: bool = True
    given: GivenOrders = field(default_factory=GivenOrders, compare=False, repr=False)

    @property
    def step(self) -> int:
        return 1 if self.batch_size is None else self.batch_size

    @property
    def count(self) -> int:
        """Samples in one epoch (this rank's share when sharded)."""
        if self.shard is None:
            return self.length
        return -(-self.length // self.shard[1])

    def __len__(self) -> int:
        # (count >= 0 and step >= 1, so both are >= 0; ceil division written without negation)
        if self.drop_last:
            return self.count // self.step
        return (self.count + self.step - 1) // self.step

    def epoch_batches(self, epoch: int) -> int:
        """Batches in ``epoch``: ``len(self)``, except in an epoch whose order is ``given``."""
        if self.given.order(epoch) is None:
            return len(self)
        n = len(self.order(epoch))
        return n // self.step if self.drop_last else -(-n // self.step)

    def order(self, epoch: int) -> np.ndarray:
        given = self.given.order(epoch)
        if given is not None:
            return given
        return epoch_order(
            self.length,
            epoch,
            self.shuffle,
            self.seed,
            self.reshuffle,
            self.shard,
            pad_to=None if self.shard is None else self.count * self.shard[1],
        )

    def batches(self, epoch: int) -> list[list[int]]:
        """The index lists of every batch of ``epoch``, in delivery order."""
        order = self.order(epoch).tolist()
        step = self.step
        return [order[i * step : (i + 1) * step] for i in range(self.epoch_batches(epoch))]


def _index(value: Any) -> int:
    """``value`` as an index: any integer type, but not a boolean (``operator.index(True)`` is 1,
    and a torch bool tensor's too), which is a mistake, not index 1."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        raise TypeError(f"a boolean ({value!r}) is not an index")
    return operator.index(value)


class ExplicitBatches:
    """The batches of each epoch come from the caller: ``batches(epoch) -> list of index lists``.

    Called once per epoch in the consumer's process. Indices may be any integer type
    (``int``, numpy integers, 0-d integer tensors); they are checked against the source's
    length so a bad index fails here, with the culprit named, not in a worker.
    """

    plan_class = IndexPlan  # each epoch: a fixed list of batches (_plan/index.py)

    def __init__(self, fn: Callable[[int], Any], length: int, unbatched: bool) -> None:
        self.fn = fn
        self.length = length
        self.unbatched = unbatched

    def __len__(self) -> int:
        try:
            return len(self.fn)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                "this Loader takes its batches from a batches= callable without __len__, so its "
                "length is unknown; give the callable a __len__ returning the batches per epoch"
            ) from None

    def batches(self, epoch: int) -> list[list[int]]:
        length, out = self.length, []
        for position, batch in enumerate(self.fn(epoch)):
            try:
                indices = [_index(i) for i in batch]
            except TypeError:
                raise TypeError(
                    f"batches({epoch}) returned batch {position} = {batch!r}: every batch must be a list "
                    "of integer indices (not booleans)"
                ) from None
            if not indices:
                raise ValueError(f"batches({epoch}) returned an empty batch at position {position}")
            if self.unbatched and len(indices) != 1:
                raise ValueError(
                    f"batches({epoch}) returned batch {position} with {len(indices)} indices, but with "
                    "batch_size=None every batch must hold exactly one index"
                )
            for i in indices:
                if not 0 <= i < length:
                    raise IndexError(
                        f"batches({epoch}) returned index {i} (batch {position}), outside the source of length {length}"
                    )
            out.append(indices)
        return out
