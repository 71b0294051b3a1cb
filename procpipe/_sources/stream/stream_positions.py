"""How a saved state holds a streaming epoch's progress: its ``StreamProgress`` state (the
interleave's cursor, the shards complete, the records received of the others) under ``stream``,
or None before anything was returned; a later epoch's as ``[epoch, stream]`` in ``ahead``. The
``PositionFormat`` of ``ShardPlan``; the order (``ShardOrder.check_progress``) checks a state
against its shards.
"""

from __future__ import annotations

from typing import Any

from ..saved_state import STREAM


class StreamPositions:
    """``PositionFormat`` of a streaming epoch: a decoded progress is a ``StreamProgress`` state, or None."""

    def empty(self) -> None:
        return None

    def write(self, done: Any) -> dict[str, Any]:
        return {STREAM: done}

    def write_ahead(self, done: Any) -> list[Any]:
        return [done]

    def read(self, order: Any, state: dict[str, Any], epoch: int) -> dict | None:
        return order.check_progress(state.get(STREAM), epoch)

    def read_ahead(self, order: Any, epoch: int, rest: list[Any]) -> dict | None:
        if len(rest) != 1 or rest[0] is None:
            raise ValueError(f"corrupt procpipe Loader state: ahead entry for epoch {epoch}: {rest!r:.200}")
        return order.check_progress(rest[0], epoch)
