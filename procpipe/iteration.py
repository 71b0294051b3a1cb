"""What an epoch iterator is given by its Loader, so that it never reads the Loader's insides.

The Loader builds one ``IterationContext`` when it is created (frozen: the sampler or
stream plan, the worker spec, the delivery settings, the coordinator) and hands it to
every iterator it makes (``iterators.EpochIterator``, ``iterators.InlineIterator``,
``streaming.InlineStream``). The one thing an iterator changes in its Loader is where
the loader stands (``Standing``): the epoch the next ``iter(loader)`` starts with, moved
along as the consumer enters later epochs, and the counters ``loader.stats()`` shows.
``LoaderIterator`` is what the Loader asks of an iterator in return (``resume_point``,
``owns_epoch``, ``cancel``, ``running``...), and the part of it the three share.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .reassembly import ResumePoint
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


class LoaderIterator:
    """What the Loader asks of each of its epoch iterators, and the part they all share.

    A subclass calls ``_attach`` first, sets ``_done`` and ``_cancelled`` (why it was
    cancelled: a new ``iter()``, ``load_state_dict``, ``close``), calls ``_set_epoch`` as its
    consumer enters epochs, and implements ``resume_point``, ``cancel`` and ``consumed``.
    """

    _standing: Standing
    _done: bool  # set by each subclass (no class default: a half-built iterator's __del__ looks for it)
    _cancelled: str | None
    _epoch_set: int | None = None  # what this iteration set ``_standing.epoch`` to last (None: nothing yet)

    def _attach(self, context: IterationContext, owner: object) -> None:
        """Take the context's ``Standing``, and hold ``owner`` (the Loader): an iteration keeps
        its Loader, hence its engine, alive, so that ``for batch in Loader(...)`` works."""
        self._standing = context.standing
        self._owner = owner

    def _set_epoch(self, epoch: int) -> None:
        """Move ``loader.epoch`` along (unless the user chose one with ``set_epoch`` meanwhile)."""
        self._epoch_set = self._standing.advance(self._epoch_set, epoch)

    def owns_epoch(self) -> bool:
        """``loader.epoch`` is still what this iteration made it (for ``state_dict``)."""
        return self._standing.set_by(self._epoch_set)

    @property
    def cancelled(self) -> str | None:
        """Why this iteration was cancelled early, or None; a stage reading the iterator in
        another thread (torch_device.py) stops on it."""
        return self._cancelled

    @property
    def running(self) -> bool:
        """Not exhausted, failed or cancelled yet (``Loader.stats()["running"]``)."""
        return not self._done

    @property
    def consumed(self) -> int | None:
        """Batches the consumer has taken of the epoch it is in (``Loader.stats()``); None when
        every batch produced was returned (``workers=0``: the counters say how many)."""
        raise NotImplementedError

    def resume_point(self) -> ResumePoint | None:
        """``(epoch, what was returned of it, of later epochs, until)`` to resume this iteration
        exactly; None once every batch of it was returned."""
        raise NotImplementedError

    def cancel(self, why: str) -> None:
        """End this iteration early (``why`` is what its next ``next()`` says)."""
        raise NotImplementedError


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
