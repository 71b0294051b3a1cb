"""``on_error="skip"``: the budget of samples an epoch may leave out.

Shared by the coordinator (faults.py) and every epoch (_engine/epochs.py, ``workers=0``'s too).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from .stats import EpochCounters

logger = logging.getLogger("procpipe")


class SkipBudget:
    """``on_error="skip"`` for one epoch: logs each skip, records it, enforces ``max_skipped``.

    ``max_skipped`` is a count (int) or a fraction (float, rounded up) of the epoch's
    ``samples``, or, where the epoch's size is not known in advance (a stream without
    ``Shards(lengths=...)``: ``samples`` is a callable), of the samples seen so far, asked at
    each skip. ``whole_batches``: a batch that failed as a whole (collation; for a streaming
    source, its shard's iterator) may be skipped too; a stream cannot, since its shard cannot
    be read past the error (the epoch would end that shard short).
    """

    def __init__(
        self,
        max_skipped: int | float,
        samples: int | Callable[[], int],
        counters: EpochCounters,
        whole_batches: bool = True,
    ) -> None:
        self._fraction = max_skipped if isinstance(max_skipped, float) else None
        self._samples = samples
        # a count, or a fraction of a known epoch size (of an unknown one, `limit` asks `samples` at each skip)
        self._limit = (
            math.ceil(max_skipped * samples)
            if self._fraction is not None and not callable(samples)
            else int(max_skipped)
        )
        self.counters = counters
        self.whole_batches = whole_batches

    @property
    def limit(self) -> int:
        """The most samples the epoch may leave out, now."""
        if self._fraction is not None and callable(self._samples):
            return math.ceil(self._fraction * self._samples())
        return self._limit

    def add(self, indices: Sequence[int | tuple[int, int]], what: str, error: str) -> bool:
        """Record ``indices`` (a streaming source's: ``(shard, record)`` keys) as skipped; False once
        the epoch has skipped more than allowed."""
        self.counters.skipped.extend(indices)
        logger.warning("procpipe skipped %s (epoch %d): %s", what, self.counters.epoch, error)
        return len(self.counters.skipped) <= self.limit

    def note(self) -> str:
        of = (
            f"; max_skipped={self._fraction} of the {self._samples()} samples seen so far"
            if self._fraction is not None and callable(self._samples)
            else ""
        )
        return (
            f"procpipe: on_error='skip' has left out {len(self.counters.skipped)} samples of epoch "
            f"{self.counters.epoch} (indices {self.counters.skipped}), more than max_skipped allows "
            f"({self.limit}{of}); this error is raised instead of being skipped."
        )
