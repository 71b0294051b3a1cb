"""``combine_states`` for a ``procpipe.Mix``: the weights the ranks' states pin, and the order they share.

Why apart: a mixture's epoch order is drawn from its sources' lengths, its nesting, each
mixture's ``stop_on_empty`` and the weights in force for the epoch, which a saved state does
not all hold (it holds the structure it is checked against, and the weights: ``mix_weights``).
So ``combine_states`` (``_sources/combine.py``) only merges what the ranks said: their positions
(indexed) or their stream progress (streams), and the weights of the combined epoch, which
every rank must agree on. The loader that loads the result has the mixture: it draws the
epoch's order again with those weights (``saved_order``), which gives back every old rank's
part (rank ``r`` of ``w`` held positions ``r, r + w, ...`` of it), hence what was delivered.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..saved_state import MIX_WEIGHTS

__all__ = ["merged_weights", "saved_order"]


def merged_weights(states: list[dict[str, Any]], epoch: int) -> dict[str, Any]:
    """``mix_weights`` of the combined state: the weights of ``epoch``, the same in every state
    that names it (``states`` sorted by rank). Raises ``ValueError`` when two ranks disagree
    (their mixtures drew different orders: exactly once cannot hold) or when no state names it."""
    seen: dict[int, tuple[int, Any]] = {}  # epoch -> (rank, weights)
    for rank, state in enumerate(states):
        entries = state.get(MIX_WEIGHTS)
        if not isinstance(entries, list):
            raise ValueError(  # noqa: TRY004 - a corrupt saved state: bad data, as every state check says
                f"procpipe.combine_states: rank {rank}'s state is from a loader over a procpipe.Mix but has "
                f"mix_weights={entries!r:.200} (a list of [epoch, weights]); the state is corrupt"
            )
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int):
                raise ValueError(
                    f"procpipe.combine_states: rank {rank}'s state has a corrupt mix_weights entry {entry!r:.200}"
                )
            number, weights = entry
            if number in seen and seen[number][1] != weights:
                other, theirs = seen[number]
                raise ValueError(
                    f"procpipe.combine_states: ranks {other} and {rank} drew epoch {number} of their procpipe.Mix "
                    f"with different weights ({theirs!r:.100} and {weights!r:.100}), so their orders differ and "
                    "no rank's part tells what the others delivered; every rank of a run must give its Mix the "
                    "same weights (or schedule)"
                )
            seen.setdefault(number, (rank, weights))
    if epoch not in seen:
        raise ValueError(
            f"procpipe.combine_states: the states are from a loader over a procpipe.Mix but none has the "
            f"weights of epoch {epoch} (mix_weights); they are corrupt"
        )
    return {MIX_WEIGHTS: [[epoch, seen[epoch][1]]]}


def saved_order(mixing: Any, state: dict[str, Any], epoch: int) -> np.ndarray:
    """``epoch``'s order before sharding, drawn by this loader's mixture (``mixing``: its
    ``MixOrder``) with the weights ``state`` saved for that epoch (checked by ``pin``, put back
    after: the load pins them again once every other check has passed)."""
    previous = mixing.pin(state)
    try:
        if not any(entry[0] == epoch for entry in state[MIX_WEIGHTS]):
            raise ValueError(f"corrupt procpipe Loader state: no mix_weights for epoch(s) [{epoch}]")
        return np.asarray(mixing.mixed_order(epoch, record=False))
    finally:
        mixing.unpin(previous)
