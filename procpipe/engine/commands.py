"""Typed commands from the consumer's thread to the coordinator thread.

The consumer never touches the coordinator's state: it queues a command
(``Coordinator.submit``) and wakes the thread, which applies the commands at the top of
its loop, in order. A command is a small slotted class, told apart by type, not a string.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .epochs import Stream


class StartStream:
    """Start ``stream`` (a new ``iter(loader)``); any stream in progress is abandoned."""

    __slots__ = ("stream",)

    def __init__(self, stream: Stream) -> None:
        self.stream = stream


class CancelStream:
    """Abandon the stream of generation ``gen``, if it is still the one in progress."""

    __slots__ = ("gen",)

    def __init__(self, gen: int) -> None:
        self.gen = gen


class CloseEngine:
    """Abandon any stream, stop every worker and remove the shared files, then leave the loop."""

    __slots__ = ()


Command = StartStream | CancelStream | CloseEngine

_BY_NAME: dict[str, type] = {"start": StartStream, "cancel": CancelStream, "close": CloseEngine}


def command_of(*parts: Any) -> Command:
    """A ``Command``, given as one (``StartStream(stream)``) or by name and arguments
    (``"start", stream``: the older spelling, still accepted)."""
    if len(parts) == 1 and isinstance(parts[0], (StartStream, CancelStream, CloseEngine)):
        return parts[0]
    if not parts or parts[0] not in _BY_NAME:
        raise ValueError(
            f"procpipe: unknown coordinator command {parts[:1]!r}; give a StartStream, "
            f"CancelStream or CloseEngine, or one of the names {sorted(_BY_NAME)}"
        )
    command: Command = _BY_NAME[parts[0]](*parts[1:])
    return command
