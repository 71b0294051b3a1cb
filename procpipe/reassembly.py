"""Reassembly: the order in which finished batches reach the consumer.

``Ordered`` is a reorder buffer keyed by the batch's position in the epoch: a batch is
released once every batch before it has been. ``Sloppy`` releases each batch as soon as
it finishes, so one slow batch does not hold back those behind it. Both release every
batch exactly once; duplicates (a straggler re-run that lost the race) are refused.
"""
from __future__ import annotations

from typing import Any


class Ordered:
    """Releases items in position order 0, 1, 2, ..."""

    def __init__(self) -> None:
        self._waiting: dict[int, Any] = {}
        self._next = 0

    def add(self, seq: int, item: Any) -> list[Any]:
        if seq < self._next or seq in self._waiting:
            return []
        self._waiting[seq] = item
        ready = []
        while self._next in self._waiting:
            ready.append(self._waiting.pop(self._next))
            self._next += 1
        return ready

    def __len__(self) -> int:
        return len(self._waiting)


class Sloppy:
    """Releases each item as soon as it arrives ("first finished, first out")."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def add(self, seq: int, item: Any) -> list[Any]:
        if seq in self._seen:
            return []
        self._seen.add(seq)
        return [item]

    def __len__(self) -> int:
        return 0
