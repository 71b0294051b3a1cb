"""Which indices each batch of an indexed source's epoch holds: ``IndexOrder`` (the loader's own
order: shuffled, sharded, batched) and ``CallerOrder`` (the caller's ``batches=`` callable,
used by ``procpipe.torch.DataLoader`` to follow a torch sampler). Anything with
``batches(epoch) -> list[list[int]]`` and ``__len__`` can stand in for an ``IndexOrder``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from ..epoch_order import GivenOrders, epoch_order
from .index_plan import IndexPlan

if TYPE_CHECKING:
    from ...config import Batching


class DrawnOrder(Protocol):
    """An indexed order drawn from settings, which a combined state can give an epoch's order
    (``given``): an ``IndexOrder``, or a mixture's ``MixOrder``."""

    @property
    def given(self) -> GivenOrders: ...

    @property
    def epoch_plan(self) -> type[IndexPlan]: ...

    def batches(self, epoch: int) -> list[list[int]]: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class IndexOrder:
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

    epoch_plan: ClassVar[type[IndexPlan]] = IndexPlan  # each epoch: a fixed list of batches (index_plan.py)

    length: int
    batch_size: int | None
    shuffle: bool
    seed: int
    drop_last: bool
    shard: tuple[int, int] | None = None
    reshuffle: bool = True
    given: GivenOrders = field(default_factory=GivenOrders, compare=False, repr=False)

    @classmethod
    def of(cls, length: int, batching: Batching) -> IndexOrder:
        """The order of ``length`` samples, from a Loader's batching group (config.py)."""
        return cls(length, **order_options(batching))

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


class CallerOrder:
    """The batches of each epoch come from the caller: ``batches(epoch) -> list of index lists``.

    Called once per epoch in the consumer's process. Indices may be any integer type
    (``int``, numpy integers, 0-d integer tensors); they are checked against the source's
    length so a bad index fails here, with the culprit named, not in a worker.
    """

    epoch_plan = IndexPlan  # each epoch: a fixed list of batches (_sources/indexed/index_plan.py)

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


def order_options(batching: Batching) -> dict[str, Any]:
    """What an indexed order takes of a Loader's batching group: ``IndexOrder.of``, ``MixOrder.of``."""
    shard = batching.shard
    return {
        "batch_size": batching.batch_size,
        "shuffle": bool(batching.shuffle),
        "seed": int(batching.seed),
        "drop_last": bool(batching.drop_last),
        "shard": None if shard is None else (shard[0], shard[1]),
        "reshuffle": bool(batching.reshuffle),
    }


__all__ = ["CallerOrder", "DrawnOrder", "IndexOrder", "order_options"]
