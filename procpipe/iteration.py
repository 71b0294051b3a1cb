"""What an epoch iterator is given by its Loader, so that it never reads the Loader's insides.

The Loader builds one ``IterationContext`` when it is created (frozen: the sampler or
stream plan, the worker spec, the delivery settings, the coordinator) and hands it to
every iterator it makes (``iterators.EpochIterator``, ``iterators.InlineIterator``,
``streaming.InlineStream``). The one thing an iterator changes in its Loader is where
the loader stands (``Standing``): the epoch the next ``iter(loader)`` starts with, moved
along as the consumer enters later epochs, and the counters ``loader.stats()`` shows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .coordinator import Coordinator
    from .stats import EpochCounters
    from .worker import WorkerSpec


class Standing:
    """Where a Loader stands, shared by the Loader and its epoch iterators.

    ``epoch``: the epoch number the next ``iter(loader)`` starts with (``Loader.epoch``,
    ``set_epoch``). ``counters``: the counters of the epoch the consumer is in, or was in
    last (what ``Loader.stats()`` shows; None before the first iteration).

    An iterator moves ``epoch`` along with ``advance``, passing what it set last, so that a
    number the user chose meanwhile (``set_epoch``) or a newer iteration set is left alone.
    """

    __slots__ = ("epoch", "counters")

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self.counters: EpochCounters | None = None

    def advance(self, mine: int | None, epoch: int) -> int | None:
        """Set ``epoch`` unless it changed since the caller last set it (``mine``; None: it
        never did); returns what the caller has set last, for its next call."""
        if mine is None or self.epoch == mine:
            self.epoch = epoch
            return epoch
        return mine

    def set_by(self, mine: int | None) -> bool:
        """``epoch`` is still what the caller set last (``mine``): its iteration decides where
        the loader stands (``Loader.state_dict``)."""
        return mine is not None and self.epoch == mine


@dataclass(frozen=True)
class IterationContext:
    """Everything an epoch iterator needs from its Loader, built once by the Loader.

    ``sampler``: the batches of each epoch (``sampler.Sampler``, ``sampler.ExplicitBatches``,
    or ``streaming.StreamPlan``); ``spec``: what the workers run (also used in the calling
    process with ``workers=0``); ``coordinator``: None with ``workers=0``.
    """

    sampler: Any
    spec: WorkerSpec
    ordered: bool
    with_epoch: bool
    max_skipped: int | float
    coordinator: Coordinator | None
    standing: Standing = field(default_factory=Standing)
