"""The kinds of a ``procpipe.Mix``: ``MixKind`` (a mixture of indexed sources, an indexed kind whose
order is drawn by weight) and ``MixStreamKind`` (a mixture holding a stream, a stream kind), and what
a mixture adds to either (``Mixing``): its weights saved with a state and pinned when one is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import combined_load
from ..indexed.index_kind import IndexedKind, indexed_length
from ..saved_state import AHEAD, COMBINED, EPOCH, MIX, STREAM, Resume, other_mixture_kind
from ..stream.interleave import merged_progress
from ..stream.stream_kind import StreamKind
from . import mix_weights
from .mix_shards import MixShardOrder
from .mixture import MixOrder

if TYPE_CHECKING:
    from ...config import LoaderConfig


class Mixing:
    """What a ``procpipe.Mix`` adds to its kind (``MixKind``, ``MixStreamKind``): the weights each
    epoch used, saved with a state (``mix_weights``) and pinned when one is loaded (``mixing``: its
    ``MixOrder``)."""

    mixing: MixOrder

    def saved_extras(self, position: dict[str, Any]) -> dict[str, Any]:
        epochs = [position[EPOCH], *(entry[0] for entry in position.get(AHEAD, []))]
        return {**super().saved_extras(position), **self.mixing.save_weights(epochs)}  # type: ignore[misc]

    def check_mixture_kind(self, state: dict[str, Any]) -> None:
        if MIX not in state:
            raise other_mixture_kind(saved_mix=False)

    def order_settings(self) -> dict[str, Any]:
        return {**super().order_settings(), MIX: self.mixing.settings()[MIX]}  # type: ignore[misc]

    def resume(self, state: dict[str, Any]) -> Resume:
        # The epochs begun are planned again with the weights they had (pinned first: a stream's
        # progress is checked against its epoch's order).
        previous = self.mixing.pin(state)
        try:
            resume = super().resume(state)  # type: ignore[misc]
            self.mixing.check_pinned([resume.epoch, *resume.ahead])
        except BaseException:
            self.mixing.unpin(previous)
            raise
        return resume


class MixKind(Mixing, IndexedKind):
    """A ``procpipe.Mix`` of indexed sources (a ``MixOrder``): its order is drawn again from the
    weights a combined state saved (``_sources/mix/mix_weights.py``)."""

    @classmethod
    def of(cls, source: Any, config: LoaderConfig) -> MixKind:
        b = config.batching
        if b.batches is not None:
            raise ValueError(
                "a procpipe.Mix draws each epoch's order from its weights, but this Loader was also "
                "given batches=..., which would replace it: leave batches= out to mix by weight"
            )
        return cls(MixOrder.of(indexed_length(source, b), b, mix=source), source)

    def __init__(self, order: MixOrder, source: Any) -> None:
        super().__init__(order, source)
        self.mixing = order.mixing

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), **self.mixing.settings()}

    def epoch_order(self, load: combined_load.CombinedLoad) -> np.ndarray:
        return mix_weights.saved_order(self.mixing, load.state, load.epoch)


class MixStreamKind(Mixing, StreamKind):
    """A ``procpipe.Mix`` holding a stream (``MixShardOrder``): its shards' order is drawn again
    from the weights a combined state saved, and the ranks' progress merged against it."""

    @classmethod
    def of(cls, source: Any, config: LoaderConfig) -> MixStreamKind:
        return cls(MixShardOrder.of(source, config.batching, config.stages, config.faults))

    def __init__(self, order: MixShardOrder) -> None:
        super().__init__(order)
        self.mixing = order.mixing

    def elastic_state(self, state: dict[str, Any]) -> dict[str, Any]:
        load = combined_load.CombinedLoad(state, self.order)
        if not load.same_settings(self.order_settings()):
            return load.out  # (the usual checks name the setting that differs)
        full = mix_weights.saved_order(self.mixing, state, load.epoch).tolist()
        load.keep_progress(ranks_progress(load, full), set(full[load.rank :: load.world]))
        return load.out


def ranks_progress(load: combined_load.CombinedLoad, full: list[int]) -> Any:
    """A mixture of streams' progress of the resumed epoch: the old ranks' raw progress (the combined
    state's ``"ranks"``) merged against ``full``, the epoch's shards before sharding; else the one saved."""
    combined = load.state[COMBINED]
    if isinstance(combined, dict) and combined_load.RANKS in combined:
        return merged_progress(combined[combined_load.RANKS], lambda r, w: full[r::w], load.settings)
    return load.state.get(STREAM)


__all__ = ["MixKind", "MixStreamKind", "Mixing", "ranks_progress"]
