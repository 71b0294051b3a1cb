"""Typed commands from the consumer's thread to the coordinator thread.

The consumer never touches the coordinator's state: it queues a command
(``Coordinator.submit``) and wakes the thread, which applies the commands at the top of
its loop, in order. A command is a small slotted class, told apart by type, not a string.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .epochs import Iteration


class StartIteration:
    """Start ``iteration`` (a new ``iter(loader)``); any iteration in progress is abandoned."""

    __slots__ = ("iteration",)

    def __init__(self, iteration: Iteration) -> None:
        self.iteration = iteration


class CancelIteration:
    """Abandon the iteration of generation ``gen``, if it is still the one in progress."""

    __slots__ = ("gen",)

    def __init__(self, gen: int) -> None:
        self.gen = gen


class ReserveSlots:
    """Keep at least ``slots`` ring slots spare for a stage of procpipe's that holds batches as
    views of the ring (``procpipe.tf.dataset``), beyond ``stage_slots``: counted in when the
    ring is made, or added to a ring that exists (a new generation with more slots)."""

    __slots__ = ("slots",)

    def __init__(self, slots: int) -> None:
        self.slots = slots


class CloseEngine:
    """Abandon any iteration, stop every worker and remove the shared files, then leave the loop."""

    __slots__ = ()


Command = StartIteration | CancelIteration | ReserveSlots | CloseEngine

_COMMANDS = (StartIteration, CancelIteration, ReserveSlots, CloseEngine)


def checked(command: object) -> Command:
    """``command``, if it is one of the command types; else a ``TypeError`` naming them (a
    command given by name, ``"start"``, is refused: the names were the older spelling)."""
    if isinstance(command, _COMMANDS):
        return command
    raise TypeError(
        f"procpipe: a coordinator command is a StartIteration, CancelIteration, ReserveSlots or CloseEngine "
        f"(procpipe._engine.commands), not {type(command).__name__} {command!r}; "
        "e.g. submit(CancelIteration(iteration.gen)) instead of submit('cancel', iteration.gen)"
    )
