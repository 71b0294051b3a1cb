"""Elastic resume: ``combine_states`` (every rank's state into one), and loading the result.

Why: a run saved by ``world_size`` ranks (each ``Loader(shard=(rank, world_size))`` saving its
own ``state_dict()``) is often resumed on another number of machines. ``combine_states``
turns the states of all the ranks into one state that a loader with *any*
``shard=(rank, world_size)`` loads: across the new ranks, every index (record) of the saved
epoch that no old rank had delivered comes exactly once, and later epochs are those of an
uninterrupted run with the new world size.

- **Indexed sources.** What each old rank delivered is a set of batch positions of its own
  part of the epoch's order; from the settings (``length``, ``batch_size``, ``shuffle``,
  ``seed``, ``reshuffle``) it is turned back into indices. The combined state keeps the
  old ranks' positions (small: ``done_below`` and ``done``, not indices) under
  ``"combined"``. A loader that loads it computes the epoch's order less what was
  delivered (``remaining``), and takes its part ``rank, rank + world_size, ...``, without
  padding (padding would deliver some twice), as the order of that epoch only
  (``Sampler.given``). So in the resumed epoch ranks may differ by one batch; later
  epochs are padded as usual. A state saved during that epoch keeps the base, so states
  can be combined again (and again) before the epoch ends.
- **Shards.** A stream's progress is kept in records of shards named by their index in
  ``Shards.shards`` (``complete`` shards, ``received`` ranges; an ordered rank's ``cursor``
  is first turned into those), so the ranks' progresses are simply merged. A loader that
  loads the result keeps the part about the shards of its own order for that epoch: each
  shard belongs to exactly one new rank, which skips what was received.
- **Mixtures** (``procpipe.Mix``): as above, but an epoch's order is the mixture's, which
  the states cannot rebuild (``_mix/elastic.py``): the combined state keeps the ranks' positions
  (indexed) or their raw stream progress (``"ranks"``), with the weights of the epoch, and the
  loader that loads it draws the order again with them before turning those into indices or
  shard progress.

Limits, said in errors: every rank of the old run must be given once, all at the same epoch
(a rank already at the next one, with nothing of it returned, counts as done); no ``ahead``
(``ordered=False`` across an epoch boundary); not with ``batches=`` or ``even_ranks=True``.
``drop_last=True`` in the resumed epoch drops, as ever, each rank's last partial batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from .._mix import elastic as elastic_mix
from .._plan.sampler import GivenOrders, epoch_order
from .._streaming.order import StreamProgress
from .state import (
    AHEAD,
    COMBINED,
    DONE,
    DONE_BELOW,
    EPOCH,
    MIX,
    MIX_WEIGHTS,
    SHARD,
    STREAM,
    UNTIL,
    VERSION,
    VERSION_KEY,
)

#: Keys of a combined state's ``COMBINED`` entry: the old ranks' entries (an indexed source's
#: positions, a mixture of streams' raw progress), and the old world size.
RANKS = "ranks"
WORLD_SIZE = "world_size"

# Keys of a saved state that say where it stands, not which loader saved it.
# (A Mix's ``mix_weights`` name epochs too: merged apart, elastic_mix.merged_weights.)
_POSITION_KEYS = (
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

__all__ = ["CombinedLoad", "combine_states", "saved_base"]


def combine_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``state_dict()`` of every rank of a run, combined into one state for any world size.

    Args:
        states: one state per rank, ``Loader(shard=(rank, world_size)).state_dict()`` for every
            ``rank`` of ``range(world_size)`` (in any order); a single unsharded loader's state
            counts as ``shard=(0, 1)``.

    Returns:
        A state for ``Loader.load_state_dict`` of a loader with the same source and settings
        and any ``shard=(rank, world_size)`` (or none): across the new ranks, every index or
        record the old ranks had not returned comes exactly once (docs/guide/scale.md).

    Raises ``ValueError`` naming the problem: a missing or repeated rank, states of
    different loaders, or what is not supported (``ahead``, ``even_ranks``, ``batches=``).
    """
    states = _checked(states)
    streaming = STREAM in states[0]
    epoch = min(state[EPOCH] for state in states)
    untils = {repr(state.get(UNTIL)) for state in states if state[EPOCH] == epoch}
    if len(untils) > 1:
        raise ValueError(
            f"procpipe.combine_states: the ranks' states stop at different epochs (until = "
            f"{', '.join(sorted(untils))}); they must come from one run"
        )
    first = next(state for state in states if state[EPOCH] == epoch)
    settings = {key: value for key, value in first.items() if key not in _POSITION_KEYS}
    out = {
        VERSION_KEY: VERSION,
        EPOCH: epoch,
        **({UNTIL: first[UNTIL]} if UNTIL in first else {}),
        **settings,
        SHARD: None,
        AHEAD: [],
    }
    if MIX in first:
        out.update(elastic_mix.merged_weights(states, epoch))
    if streaming:
        entries = _stream_entries(states, epoch)
        if MIX in first:  # (each rank's shards come from the mixture's order: merged by the loader that loads it)
            out[STREAM] = None
            out[COMBINED] = {WORLD_SIZE: len(states), RANKS: entries}
        else:
            out[STREAM] = _merged_progress(entries, functools.partial(_shard_order, settings, epoch), settings)
            out[COMBINED] = {WORLD_SIZE: len(states)}
    else:
        out.update(done_below=0, done=[])
        base = next((state[COMBINED] for state in states if state[EPOCH] == epoch and COMBINED in state), None)
        out[COMBINED] = {RANKS: [_rank_entry(state, epoch, base) for state in states]}
    return out


def _checked(states: Any) -> list[dict[str, Any]]:
    """``states`` as a list sorted by rank, checked: one state per rank of one run."""
    if isinstance(states, dict) or not isinstance(states, (list, tuple)):
        raise TypeError(
            "procpipe.combine_states takes a list of state dicts, one per rank "
            f"(Loader.state_dict() of each), got {type(states).__name__}"
        )
    if not states:
        raise ValueError("procpipe.combine_states: no state given (one per rank is needed)")
    for i, state in enumerate(states):
        if not isinstance(state, dict) or state.get(VERSION_KEY) != VERSION or EPOCH not in state:
            raise ValueError(
                f"procpipe.combine_states: states[{i}] is not a procpipe Loader state "
                f"(from Loader.state_dict()): {state!r:.200}"
            )
        if state.get(AHEAD):
            raise ValueError(
                f"procpipe.combine_states: states[{i}] has batches of a later epoch already returned "
                "(ordered=False across an epoch boundary), which cannot be combined yet; save the "
                "states with ordered=True, or between epochs"
            )
        if state.get("even_ranks"):
            raise ValueError(
                "procpipe.combine_states: states saved with even_ranks=True cannot be combined yet "
                "(the records each rank left out depend on the world size)"
            )
        combined = state.get(COMBINED)
        if (
            state.get(SHARD) is None
            and isinstance(combined, dict)
            and (STREAM not in state or RANKS in combined)  # (a plain stream's is a progress like any)
        ):
            raise ValueError(
                f"procpipe.combine_states: states[{i}] is itself a combined state, not yet loaded by "
                "any rank; load it into the new ranks' loaders (or use it as it is)"
            )
    kinds = {STREAM in state for state in states}
    if len(kinds) > 1:
        raise ValueError(
            "procpipe.combine_states: the states mix an indexable source and a streaming source "
            "(procpipe.Shards); they must come from one run"
        )
    settings = [{k: v for k, v in state.items() if k not in _POSITION_KEYS} for state in states]
    for i, other in enumerate(settings[1:], 1):
        if other != settings[0]:
            diff = sorted(k for k in set(other) | set(settings[0]) if other.get(k) != settings[0].get(k))
            raise ValueError(
                f"procpipe.combine_states: states[{i}] was saved by a loader with other settings than "
                f"states[0] ({', '.join(diff)}); the states must come from the ranks of one run"
            )
    shards = [tuple(state[SHARD]) if state.get(SHARD) is not None else (0, 1) for state in states]
    world = shards[0][1]
    if any(w != world for _, w in shards) or sorted(r for r, _ in shards) != list(range(world)):
        raise ValueError(
            f"procpipe.combine_states: the states must be those of every rank of one run, each once; "
            f"got shard= {sorted(shards)} (world_size {world} needs ranks 0 to {world - 1})"
        )
    return [state for _, state in sorted(zip(shards, states, strict=True), key=lambda pair: pair[0])]


# ---------------------------------------------------------------------- indexed sources
def _rank_entry(state: dict[str, Any], epoch: int, base: dict | None) -> dict[str, Any]:
    """One old rank in a combined state: its shard, the positions it returned in ``epoch``
    (``done_below=None``: all, a rank already past the epoch) and the base it was resumed from."""
    shard = list(state[SHARD]) if state.get(SHARD) is not None else [0, 1]
    if state[EPOCH] == epoch:
        entry = {SHARD: shard, DONE_BELOW: state[DONE_BELOW], DONE: list(state[DONE])}
        own = state.get(COMBINED)
    elif state[EPOCH] == epoch + 1 and not state.get(DONE_BELOW) and not state.get(DONE):
        entry, own = {SHARD: shard, DONE_BELOW: None, DONE: []}, base
    else:
        raise ValueError(
            f"procpipe.combine_states: rank {shard[0]}'s state is at epoch {state['epoch']} (with "
            f"batches of it returned), the others' at epoch {epoch}; save every rank in the same epoch"
        )
    if own is not None:
        entry[COMBINED] = own
    return entry


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
            if padded is None:  # (Sampler's and MixSampler's padding: to a multiple of world)
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


# ---------------------------------------------------------------------- Shards
def _stream_entries(states: list[dict[str, Any]], epoch: int) -> list[dict[str, Any]]:
    """Each old rank's part of ``epoch``: its shard, whether it was past the epoch (every shard of
    its order read), and its stream progress (None: nothing returned)."""
    entries = []
    for state in states:
        rank, world = state[SHARD] if state.get(SHARD) is not None else (0, 1)
        past = state[EPOCH] != epoch
        if past and not (state[EPOCH] == epoch + 1 and state.get(STREAM) is None):
            raise ValueError(
                f"procpipe.combine_states: rank {rank}'s state is at epoch {state['epoch']} (with "
                f"records of it returned), the others' at epoch {epoch}; save every rank in the same "
                "epoch"
            )
        entries.append({SHARD: [rank, world], "past": past, STREAM: None if past else state.get(STREAM)})
    return entries


def _shard_order(settings: dict[str, Any], epoch: int, rank: int, world: int) -> list[int]:
    """A ``Shards`` source's shards of ``epoch`` for rank ``rank`` of ``world`` (``StreamPlan.batches``)."""
    return epoch_order(
        settings["shards"], epoch, settings["shuffle"], settings["seed"], settings.get("reshuffle", True), (rank, world)
    ).tolist()


def _merged_progress(
    entries: list[dict[str, Any]], order_of: Callable[[int, int], list[int]], settings: dict[str, Any]
) -> dict[str, Any]:
    """Every rank's progress (``_stream_entries``) in shard terms (no cursor), merged;
    ``order_of(rank, world)``: the shards of that rank's order in the epoch."""
    complete: set[int] = set()
    received: list[list[int]] = []
    for entry in entries:
        order = order_of(*entry[SHARD])
        if entry["past"]:
            complete.update(order)  # past the epoch: every shard of it read
            continue
        if entry[STREAM] is None:
            continue
        progress = StreamProgress(
            order, settings["cycle_length"], settings["block_length"], False, entry[STREAM]
        ).state()  # (a cursor unfolded into complete / received)
        complete.update(progress["complete"])
        received.extend(progress["received"])
    received.sort()
    merged: list[list[int]] = []
    for shard, start, stop in received:
        if shard in complete:
            continue
        if merged and merged[-1][0] == shard and start <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], stop)
        else:
            merged.append([shard, start, stop])
    return {"cursor": None, "complete": sorted(complete), "received": merged}


# ---------------------------------------------------------------------- loading and saving
class CombinedLoad:
    """A state holding ``"combined"`` being made into this loader's own, whose plan is ``plan``:
    its shard checked (a state saved in an epoch resumed from a combined state belongs to that
    rank), ``out`` the state as this rank's (``"combined"`` dropped), and the steps a source kind
    (``_consumer/kinds.py``: its ``elastic_state``) takes with it: for an indexed source, the
    resumed epoch's order given to the sampler (``give``); for a ``Shards`` source, the progress
    about the shards of this rank's order (``keep_progress``). The result is checked as usual."""

    def __init__(self, state: dict[str, Any], plan: Any) -> None:
        mine = getattr(plan, "shard", None)
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
        self.settings = {key: value for key, value in state.items() if key not in _POSITION_KEYS}
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

    def ranks_progress(self, full: list[int]) -> Any:
        """A stream's progress of the resumed epoch: the old ranks' raw progress (a mixture's
        ``"ranks"``) merged against ``full``, the epoch's shards before sharding; else the one saved."""
        combined = self.state[COMBINED]
        if isinstance(combined, dict) and RANKS in combined:
            return _merged_progress(combined[RANKS], lambda r, w: full[r::w], self.settings)
        return self.state.get(STREAM)

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
