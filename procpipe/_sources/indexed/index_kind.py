"""The kinds of an indexed source (``len``, ``[i]``): ``IndexedKind`` (the loader's own order, a
``IndexOrder``) and ``CallerKind`` (the caller's, ``batches=...``). Both read by index in the workers
(``IndexProducer``) and name a sample by its index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..._worker.index_producer import IndexProducer
from .. import combined_load
from ..sample_names import IndexNames
from ..saved_state import EPOCH
from ..source_kind import SourceKind
from .index_order import CallerOrder, DrawnOrder, IndexOrder

if TYPE_CHECKING:
    from ...config import Batching, LoaderConfig
    from ..epoch_order import GivenOrders


def indexed_length(source: Any, batching: Batching) -> int:
    """``len(source)``, once ``source`` is checked to be indexable and given no stream's option."""
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise TypeError(
            f"source must support len() and indexing with an int (a list, a numpy array, a torch Dataset...); "
            f"got {type(source).__name__}, which lacks "
            f"{'__len__' if not hasattr(source, '__len__') else '__getitem__'}. Wrap iterables in a list first."
        )
    if batching.shuffle_buffer is not None:
        raise ValueError(
            "shuffle_buffer applies to streaming sources (procpipe.Shards); an indexable "
            "source is shuffled whole with shuffle=True"
        )
    return len(source)


class CallerKind(SourceKind):
    """An indexed source read in the caller's order (``batches=...``, ``CallerOrder``): a
    combined state cannot split it anew."""

    @classmethod
    def of(cls, source: Any, config: LoaderConfig) -> CallerKind:
        b = config.batching
        explicit = CallerOrder(b.batches, indexed_length(source, b), b.batch_size is None)  # type: ignore[arg-type]
        return cls(explicit, source, IndexProducer(source), IndexNames())

    def elastic_state(self, state: dict[str, Any]) -> dict[str, Any]:
        combined_load.CombinedLoad(state, self.order)  # (this rank's shard checked first, as for every kind)
        raise ValueError(
            "a combined state (procpipe.combine_states) resumes a loader whose batches come from its "
            "own sampler; this loader's come from batches=..., which cannot be split anew"
        )


class IndexedKind(SourceKind):
    """An indexed source (``len``, ``[i]``) with an ``IndexOrder``: a combined state gives it the order
    of the epoch it resumes (``given``: ``GivenOrders``)."""

    warns_when_empty = True

    @classmethod
    def of(cls, source: Any, config: LoaderConfig) -> IndexedKind:
        return cls(IndexOrder.of(indexed_length(source, config.batching), config.batching), source)

    def __init__(self, order: DrawnOrder, source: Any) -> None:
        super().__init__(order, source, IndexProducer(source), IndexNames())
        self.given: GivenOrders = order.given

    def saved_extras(self, position: dict[str, Any]) -> dict[str, Any]:
        return combined_load.saved_base(self.given, position[EPOCH])

    def order_settings(self) -> dict[str, Any]:
        """The settings an epoch's order is drawn from (a combined state's must be the same)."""
        order: Any = self.order
        keys = ("shuffle", "seed", "reshuffle", "length", "batch_size", "drop_last")
        return {key: getattr(order, key) for key in keys}

    def epoch_order(self, load: combined_load.CombinedLoad) -> np.ndarray:
        """The resumed epoch's order before sharding."""
        return load.full_order()

    def elastic_state(self, state: dict[str, Any]) -> dict[str, Any]:
        load = combined_load.CombinedLoad(state, self.order)
        if load.same_settings(self.order_settings()):
            load.give(self.epoch_order(load), self.given)
        return load.out

    def forget_combined(self) -> None:
        self.given.forget()


__all__ = ["CallerKind", "IndexedKind", "indexed_length"]
