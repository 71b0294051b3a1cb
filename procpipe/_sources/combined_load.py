"""Loading a combined state (``procpipe.combine_states``, ``combine.py``): ``CombinedLoad``, the steps
each source kind takes to make it this rank's own (its ``elastic_state``), and the base a state saved
in a resumed epoch keeps (``saved_base``). Below the kinds: each kind's package uses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .epoch_order import epoch_order
from .saved_state import (
    AHEAD,
    COMBINED,
    DONE,
    DONE_BELOW,
    EPOCH,
    MIX_WEIGHTS,
    SHARD,
    STREAM,
    UNTIL,
    VERSION_KEY,
)

if TYPE_CHECKING:
    from .epoch_order import GivenOrders

#: Keys of a combined state's ``COMBINED`` entry: the old ranks' entries (an indexed source's
#: positions, a mixture of streams' raw progress), and the old world size.
RANKS = "ranks"
WORLD_SIZE = "world_size"

# Keys of a saved state that say where it stands, not which loader saved it.
# (A Mix's ``mix_weights`` name epochs too: merged apart, elastic_mix.merged_weights.)
POSITION_KEYS = (
    VERSION_KEY,
    EPOCH,
    DONE_BELOW,
    DONE,
    AHEAD,
    UNTIL,
    STREAM,
    COMBINED,
    SHARD,
    MIX_WEIGHTS,
)


def _full_order(settings: dict[str, Any], epoch: int) -> np.ndarray:
    return epoch_order(
        settings["length"], epoch, settings["shuffle"], settings["seed"], settings.get("reshuffle", True), None
    )


def _delivered(settings: dict[str, Any], full: np.ndarray, combined: dict[str, Any]) -> np.ndarray:
    """A mask over the source's indices: those some old rank of ``combined`` returned in the
    epoch whose order (unsharded) is ``full``."""
    length, step = settings["length"], settings["batch_size"] or 1
    mask = np.zeros(length, dtype=bool)
    padded: np.ndarray | None = None  # the epoch's order padded for the old world size: rank r's part is [r::world]
    remaining: dict[int, np.ndarray] = {}  # id of a base -> the order it left (every rank resumed from one base)
    for entry in combined[RANKS]:
        rank, world = entry[SHARD]
        inner = entry.get(COMBINED)
        if inner is not None:
            if id(inner) not in remaining:
                before = _delivered(settings, full, inner)
                mask |= before
                remaining[id(inner)] = _remaining(full, before)
            order = remaining[id(inner)][rank::world]
        else:
            if padded is None:  # (IndexOrder's and MixOrder's padding: to a multiple of world)
                padded = np.resize(full, -(-len(full) // world) * world)
            order = padded[rank::world]
        below = entry[DONE_BELOW]
        if below is None:  # a rank past the epoch: every batch of its part (drop_last: not the partial one)
            below = len(order) // step if settings["drop_last"] else -(-len(order) // step)
        mask[order[: below * step]] = True
        for position in entry[DONE]:
            mask[order[position * step : (position + 1) * step]] = True
    return mask


def _remaining(full: np.ndarray, delivered: np.ndarray) -> np.ndarray:
    """The epoch's order ``full`` (unsharded) less the indices ``delivered``."""
    return full[~delivered[full]]


class CombinedLoad:
    """A state holding ``"combined"`` being made into this loader's own, whose order is ``order``:
    its shard checked (a state saved in an epoch resumed from a combined state belongs to that
    rank), ``out`` the state as this rank's (``"combined"`` dropped), and the steps a source kind
    (``_sources/resolve.py``: its ``elastic_state``) takes with it: for an indexed source, the
    resumed epoch's order given to the order (``give``); for a ``Shards`` source, the progress
    about the shards of this rank's order (``keep_progress``). The result is checked as usual."""

    def __init__(self, state: dict[str, Any], order: Any) -> None:
        mine = getattr(order, "shard", None)
        saved = state.get(SHARD)
        if saved is not None and (mine is None or list(mine) != list(saved)):
            raise ValueError(
                f"this state was saved by rank {saved[0]} of {saved[1]} in an epoch resumed from "
                f"procpipe.combine_states, but this loader has shard={mine!r}; resume it with shard="
                f"({saved[0]}, {saved[1]}), or combine it with the other ranks' states first"
            )
        self.state = state
        self.epoch = cast(int, state.get(EPOCH))  # (checked with the rest of the result, as usual)
        self.out = {key: value for key, value in state.items() if key != COMBINED}
        self.out[SHARD] = None if mine is None else list(mine)
        #: the saved settings (not where the state stands)
        self.settings = {key: value for key, value in state.items() if key not in POSITION_KEYS}
        rank, world = mine if mine is not None else (0, 1)
        self.rank: int = rank
        self.world: int = world

    def same_settings(self, mine: dict[str, Any]) -> bool:
        """The settings an epoch's order is drawn from (``mine``: the loader's, by key) are those saved
        (if not, the load's usual checks name the one that differs)."""
        return all(self.settings.get(key, True if key == "reshuffle" else None) == value for key, value in mine.items())

    def full_order(self) -> np.ndarray:
        """An indexed source's order of the resumed epoch, before sharding, from the saved settings."""
        return _full_order(self.settings, self.epoch)

    def give(self, full: np.ndarray, given: GivenOrders) -> None:
        """Give ``given`` this rank's part of the resumed epoch (whose order before sharding is
        ``full``) less what the old ranks delivered."""
        combined = self.state[COMBINED]
        rank_order = _remaining(full, _delivered(self.settings, full, combined))[self.rank :: self.world]
        given.give(self.epoch, rank_order, combined)

    def keep_progress(self, progress: Any, order: set[int]) -> None:
        """Keep of ``progress`` (a stream's, merged) what is about the shards of ``order``, this rank's."""
        if progress is not None and isinstance(progress, dict):
            self.out[STREAM] = {
                "cursor": None,
                "complete": [s for s in progress.get("complete", []) if s in order],
                "received": [
                    entry
                    for entry in progress.get("received", [])
                    if isinstance(entry, list) and entry and entry[0] in order
                ],
            }


def saved_base(given: GivenOrders | None, epoch: int) -> dict[str, Any]:
    """What a state saved in ``epoch`` adds: the combined state it resumed from, if the epoch is one."""
    base = None if given is None else given.base(epoch)
    return {} if base is None else {COMBINED: base}


__all__ = ["POSITION_KEYS", "RANKS", "WORLD_SIZE", "CombinedLoad", "saved_base"]
