"""Elastic resume: ``combine_states``, every rank's state into one (loading the result: ``combined_load.py``).

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
  (``IndexOrder.given``). So in the resumed epoch ranks may differ by one batch; later
  epochs are padded as usual. A state saved during that epoch keeps the base, so states
  can be combined again (and again) before the epoch ends.
- **Shards.** A stream's progress is kept in records of shards named by their index in
  ``Shards.shards`` (``complete`` shards, ``received`` ranges; an ordered rank's ``cursor``
  is first turned into those), so the ranks' progresses are simply merged. A loader that
  loads the result keeps the part about the shards of its own order for that epoch: each
  shard belongs to exactly one new rank, which skips what was received.
- **Mixtures** (``procpipe.Mix``): as above, but an epoch's order is the mixture's, which
  the states cannot rebuild (``_sources/mix/mix_weights.py``): the combined state keeps the ranks' positions
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
from collections.abc import Sequence
from typing import Any

from .combined_load import POSITION_KEYS, RANKS, WORLD_SIZE
from .epoch_order import epoch_order
from .mix import mix_weights as elastic_mix
from .saved_state import (
    AHEAD,
    COMBINED,
    DONE,
    DONE_BELOW,
    EPOCH,
    MIX,
    SHARD,
    STREAM,
    UNTIL,
    VERSION,
    VERSION_KEY,
)
from .stream.interleave import merged_progress

__all__ = ["combine_states"]


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
    settings = {key: value for key, value in first.items() if key not in POSITION_KEYS}
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
            out[STREAM] = merged_progress(entries, functools.partial(_shard_order, settings, epoch), settings)
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
    settings = [{k: v for k, v in state.items() if k not in POSITION_KEYS} for state in states]
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
    """A ``Shards`` source's shards of ``epoch`` for rank ``rank`` of ``world`` (``ShardOrder.batches``)."""
    return epoch_order(
        settings["shards"], epoch, settings["shuffle"], settings["seed"], settings.get("reshuffle", True), (rank, world)
    ).tolist()
