"""The plan of one epoch of an indexed source (``len`` + ``__getitem__``): ``IndexPlan``.

The epoch is a fixed list of batches of indices (index_order.py); each batch is one task,
keyed by its position. Results pass through the epoch's reassembly (reassembly.py:
``Ordered`` or ``Sloppy``), which hands each position out once. What the consumer has had
is a set of positions (``Progress``); a resumed epoch leaves those out. The contract is
``_sources.epoch_plan.EpochPlan``'s.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

from ..._core import collate
from ..._core.reassembly import Ordered, Progress, Sloppy
from ..._core.shm import ALIGN
from ..epoch_plan import EMPTY, EpochPlan, Loaded, Offer, Ready, Work, ready
from .index_positions import IndexPositions

_FRESH = (Offer((1,)),)  # the next batch never sent (any worker)


class IndexPlan(EpochPlan):
    """One epoch's batches of indices (``batches``); ``done``: positions delivered before a resume."""

    skips_tasks = True  # on_error="skip" may leave out a batch whose collation failed
    positions = IndexPositions()

    def __init__(
        self, order: Any, number: int, batches: list[list[int]], ordered: bool, done: Any = frozenset()
    ) -> None:
        self.batches = batches
        self.ordered = ordered
        done = frozenset(s for s in (done or ()) if 0 <= s < len(batches))
        self.reassembly = (Ordered if ordered else Sloppy)(done)
        self.remaining = len(batches) - len(done)  # positions to hand out
        self.handed_out = 0
        self._done = done
        self._next = 0  # the next position never sent
        self._skip_done()
        self._retries: list[tuple[int, Work]] = []  # (key, work), sorted: lost tasks to run again
        self.progress = Progress(done)  # what the consumer has had (consumer thread)
        self.empty: list[int] = []  # positions every sample of which was skipped (nothing to take)
        # assign="round_robin": batch k is offered to worker k % len(_rotation) (empty: any worker)
        self._rotation: tuple[Sequence[Offer], ...] = ()

    def _skip_done(self) -> None:
        while self._next in self._done:
            self._next += 1

    # ---- dispatch
    @property
    def exhausted(self) -> bool:
        return self._next >= len(self.batches)

    def offers(self, per_lane: int) -> Sequence[Offer]:
        if self._retries:
            return [Offer((0,), retry=self._retries[0][1])]  # (any worker: its own one died)
        if self._next >= len(self.batches):
            return ()
        rotation = self._rotation
        return rotation[self._next % len(rotation)] if rotation else _FRESH

    def rotate(self, workers: int) -> None:
        self._rotation = tuple((Offer((1,), lane=w, worker=w),) for w in range(workers))  # made once, not per batch

    def take(self, offer: Offer, worker: int) -> Work:
        if offer.retry is not None:
            return self._retries.pop(0)[1]
        seq = self._next
        self._next = seq + 1
        if self._done:
            self._skip_done()
        return Work(seq, self.batches[seq])

    def lost(self, work: Work) -> bool:
        bisect.insort(self._retries, (work.key, work), key=lambda entry: entry[0])
        return True

    def held(self) -> int:
        return len(self.reassembly)

    # ---- results
    def slot_bytes(self, work: Work, layout: list, nbytes: int, skipped: int) -> int | None:
        """A short batch (the epoch's last, or one with skipped samples) often arrives first;
        it must not size the slots, or every full batch after it would overflow: its size
        is scaled up to the epoch's largest batch, plus each array's alignment padding."""
        samples = len(work.payload) - skipped
        full = max(map(len, self.batches), default=samples)
        if samples <= 0 or samples >= full:
            return nbytes
        return -(-nbytes * full // samples) + ALIGN * collate.count_arrays(layout)

    def completed(self, work: Work, result: Any) -> list[Ready]:
        if type(result) is Loaded:
            item = ready(work.key, collate.build(result.layout, result.lease), len(work.payload) - result.skipped)
        else:  # EMPTY, or a Failure
            item = ready(work.key, result, 0)
            if result is EMPTY:
                self.empty.append(work.key)  # nothing there to take, ever: done for a resume
        out = self.reassembly.add(work.key, item)
        self.handed_out += len(out)
        return out

    @property
    def complete(self) -> bool:
        return self.handed_out >= self.remaining

    def sample_total(self) -> int:
        return sum(map(len, self.batches))

    def finish(self) -> None:
        self.reassembly.drop_waiting()  # batches that will never be delivered (cancelled, or behind a failure)

    # ---- the consumer's side
    def taken(self, position: int) -> None:
        self.progress.add(position)

    def state(self) -> Progress:
        """The positions the consumer has had, plus those that came out empty."""
        done = Progress(self.progress)
        for seq in list(self.empty):
            done.add(seq)
        return done

    def all_taken(self) -> bool:
        return len(self.state()) >= len(self.batches)

    @classmethod
    def unopened_state(cls, resumed: Any) -> Progress:
        return Progress(resumed or ())
