"""Reassembly: the order in which finished batches reach the consumer, and what it has had.

``Ordered`` is a reorder buffer keyed by the batch's position in the epoch: a batch is
released once every batch before it has been. ``Sloppy`` releases each batch as soon as
it finishes, so one slow batch does not hold back those behind it. Both release every
batch exactly once; duplicates (a straggler re-run that lost the race) are refused.
Both accept the positions already delivered before a resume (``done``): those are never
expected again.

``Progress`` records which positions the consumer has received, compactly: a watermark
below which every position is done, plus the few done beyond it (sloppy order). It is
what ``Loader.state_dict()`` saves.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple


class Ordered:
    """Releases items in position order 0, 1, 2, ..., skipping ``done``."""

    def __init__(self, done: Iterable[int] = ()) -> None:
        self._waiting: dict[int, Any] = {}
        self._done = frozenset(done)
        self._next = 0
        self._skip_done()

    def _skip_done(self) -> None:
        while self._next in self._done:
            self._next += 1

    def add(self, seq: int, item: Any) -> list[Any]:
        """``item`` (at position ``seq``) arrived: the items now released, in order."""
        if seq < self._next or seq in self._waiting or seq in self._done:
            return []
        self._waiting[seq] = item
        ready = []
        while self._next in self._waiting:
            ready.append(self._waiting.pop(self._next))
            self._next += 1
            self._skip_done()
        return ready

    def __len__(self) -> int:
        return len(self._waiting)

    def drop_waiting(self) -> None:
        """Forget the batches held back for an earlier one: they will never be released (the
        epoch was cancelled, or a failure ended it), and each holds a ring slot's views."""
        self._waiting.clear()


class Sloppy:
    """Releases each item as soon as it arrives ("first finished, first out")."""

    def __init__(self, done: Iterable[int] = ()) -> None:
        self._seen: set[int] = set(done)

    def add(self, seq: int, item: Any) -> list[Any]:
        """``item`` (at position ``seq``) arrived: released at once, unless ``seq`` was seen."""
        if seq in self._seen:
            return []
        self._seen.add(seq)
        return [item]

    def __len__(self) -> int:
        return 0

    def drop_waiting(self) -> None:
        """Nothing is ever held back here (see ``Ordered.drop_waiting``)."""


class Progress:
    """The positions of an epoch that are done: every one below ``below``, plus ``beyond``."""

    __slots__ = ("below", "beyond")
    below: int
    beyond: set[int]

    def __init__(self, done: Iterable[int] = ()) -> None:
        if type(done) is Progress:  # a copy, without walking every position below the watermark
            self.below, self.beyond = done.below, set(done.beyond)
            return
        self.below = 0
        self.beyond = set()
        for seq in done:
            self.add(seq)

    def add(self, seq: int) -> None:
        if seq < self.below:
            return
        if seq != self.below:
            self.beyond.add(seq)
            return
        self.below += 1
        beyond = self.beyond
        while self.below in beyond:
            beyond.remove(self.below)
            self.below += 1

    def __contains__(self, seq: int) -> bool:
        return seq < self.below or seq in self.beyond

    def __len__(self) -> int:
        return self.below + len(self.beyond)

    def __iter__(self):
        yield from range(self.below)
        yield from sorted(self.beyond)


class ResumePoint(NamedTuple):
    """Where the consumer stands, to resume exactly there (``Loader.state_dict``).

    ``done``: what it has had of ``epoch``; ``ahead``: of later epochs (an ordered stream
    can have batches of the next epoch while this one still waits); both in the form an
    epoch's ``consumer_progress()`` gives. ``until``: the epoch the iteration stops before
    (None: endless).
    """

    epoch: int
    done: Any
    ahead: dict[int, Any]
    until: int | None
