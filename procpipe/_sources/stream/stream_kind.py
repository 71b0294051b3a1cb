"""The kind of a stream: ``procpipe.Shards`` (the torch facade's ``IterableDataset`` replicas are
one), read in blocks of records by lane (``ShardPlan``); a record is named by ``(shard, record)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import combined_load
from ..sample_names import RecordNames
from ..saved_state import STREAM, other_source_kind
from ..source_kind import SourceKind
from .shard_order import ShardOrder

if TYPE_CHECKING:
    from ...config import LoaderConfig


class StreamKind(SourceKind):
    """A stream: ``Shards`` (the torch facade's ``IterableDataset`` replicas are one)."""

    described = "a streaming source (procpipe.Shards)"

    @classmethod
    def of(cls, source: Any, config: LoaderConfig) -> StreamKind:
        return cls(ShardOrder.of(source, config.batching, config.stages, config.faults))

    def __init__(self, order: ShardOrder) -> None:
        # (the source stays the Shards the order reads; the workers read its blocks with the order's ShardProducer)
        super().__init__(order, order.shards, order.producer, RecordNames())

    def settings(self) -> dict[str, Any]:
        return self.order.settings()  # type: ignore[attr-defined]  # (a ShardOrder)

    def check_positions_kind(self, state: dict[str, Any]) -> None:
        if STREAM not in state:
            raise other_source_kind("an indexable source", self.described)

    def order_settings(self) -> dict[str, Any]:
        """The settings an epoch's order of shards is drawn from."""
        mine = self.settings()
        return {key: mine[key] for key in ("shuffle", "seed", "reshuffle", "shards", "cycle_length", "block_length")}

    def elastic_state(self, state: dict[str, Any]) -> dict[str, Any]:
        load = combined_load.CombinedLoad(state, self.order)
        load.keep_progress(state.get(STREAM), set(self.order.batches(load.epoch)))
        return load.out


__all__ = ["StreamKind"]
