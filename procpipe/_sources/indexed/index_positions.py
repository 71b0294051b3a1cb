"""How a saved state holds an indexed epoch's progress: the batch positions returned, as
``done_below`` (every position below it) and ``done`` (those beyond, sorted); a later epoch's as
``[epoch, done_below, done]`` in ``ahead``. The ``PositionFormat`` of ``IndexPlan`` (the epochs of
an ``IndexOrder``, a ``CallerOrder`` and a ``MixOrder``).
"""

from __future__ import annotations

import itertools
from typing import Any

from ..._core.checks import is_count
from ..._core.reassembly import Progress
from ..saved_state import DONE, DONE_BELOW


class IndexPositions:
    """``PositionFormat`` of an indexed epoch: a decoded progress is a frozenset of positions."""

    def empty(self) -> Progress:
        return Progress()

    def write(self, done: Any) -> dict[str, Any]:
        below, beyond = self.write_ahead(done)
        return {DONE_BELOW: below, DONE: beyond}

    def write_ahead(self, done: Any) -> list[Any]:
        done = _as_progress(done)
        return [done.below, sorted(done.beyond)]

    def read(self, order: Any, state: dict[str, Any], epoch: int) -> frozenset:
        return self.read_ahead(order, epoch, [state.get(DONE_BELOW), state.get(DONE)])

    def read_ahead(self, order: Any, epoch: int, rest: list[Any]) -> frozenset:
        """``[done_below, done]``, checked: a position past the epoch's batches is refused before
        any set is built (``done_below=10**10`` would otherwise exhaust memory)."""
        count = _batch_count(order, epoch)
        ok = len(rest) == 2
        if ok:
            below, beyond = rest
            ok = is_count(below, 0) and isinstance(beyond, list) and all(is_count(x, below + 1) for x in beyond)
        if not ok:
            raise ValueError(f"corrupt procpipe Loader state: done_below, done = {rest!r:.200} for epoch {epoch}")
        if count is not None and (below > count or (beyond and max(beyond) >= count)):
            raise ValueError(
                f"procpipe Loader state out of range: done_below, done = {rest!r:.200} for epoch {epoch}, "
                f"but an epoch of this loader has {count} batches (positions 0 to {count - 1}); "
                "the state is corrupt or from another loader"
            )
        return frozenset(itertools.chain(range(below), beyond))


def _as_progress(done: Any) -> Progress:
    """Positions returned, as a ``Progress`` (a decoded position holds frozensets)."""
    return done if isinstance(done, Progress) else Progress(done or ())


def _batch_count(order: Any, epoch: int) -> int | None:
    """Batches in ``epoch``, if the order knows (a ``batches=`` callable without ``__len__`` does not;
    an ``IndexOrder`` resumed from ``procpipe.combine_states`` has its own count for the resumed epoch)."""
    per_epoch = getattr(order, "epoch_batches", None)
    try:
        return per_epoch(epoch) if per_epoch is not None else len(order)
    except TypeError:
        return None
