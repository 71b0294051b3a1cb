"""What an epoch iterator is given by its Loader, so that it never reads the Loader's insides.

The Loader builds one ``IterationContext`` when it is created (frozen: the source kind's
order, the worker spec, the delivery settings, the coordinator) and hands it to
every iterator it makes (``epoch_iterator.EpochIterator``, and ``inline.InlineDriver`` for
``workers=0``). The one thing an iterator changes in its Loader is where
the loader stands (``Standing``): the epoch the next ``iter(loader)`` starts with, moved
along as the consumer enters later epochs, and the counters ``loader.stats()`` shows.
``LoaderIterator`` is what the Loader asks of an iterator in return (``owns_epoch``,
``cancel``, ``running``...), and the part of it the two share: each is a source node
(procpipe/_consumer/nodes.py), whose ``get_state()`` is where its consumer stands (a position,
procpipe/_sources/saved_state.py) and whose ``reset(state)`` restarts it there.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from .._engine.epochs import iteration_over
from .._sources.saved_state import decode_position, encode_position, start_position
from .nodes import Node

if TYPE_CHECKING:
    from .._core.reassembly import ResumePoint
    from .._core.stats import EpochCounters
    from .._engine.coordinator import Coordinator
    from .._engine.epochs import Iteration
    from .._worker.worker_spec import WorkerSpec


class Standing:
    """Where a Loader stands, shared by the Loader and its epoch iterators.

    ``epoch``: the epoch number the next ``iter(loader)`` starts with (``Loader.epoch``,
    ``set_epoch``). ``counters``: the counters of the epoch the consumer is in, or was in
    last (what ``Loader.stats()`` shows; None before the first iteration).

    An iterator moves ``epoch`` along with ``advance``, passing what it set last, so that a
    number the user chose meanwhile (``set_epoch``) or a newer iteration set is left alone.
    """

    __slots__ = ("counters", "epoch")

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


class LoaderIterator(Node):
    """What the Loader asks of each of its epoch iterators (source nodes), and the part they all share.

    A subclass calls ``_attach`` first, then ``reset(state)``; it sets ``_done`` and
    ``_cancelled`` (why it was cancelled: a new ``iter()``, ``load_state_dict``, ``close``),
    calls ``_set_epoch`` as its consumer enters epochs, and implements ``_start`` (begin an
    iteration at a decoded position), ``_halt`` (end the running one quietly, before a
    reset), ``_point`` and ``_next_start`` (for ``get_state``), ``cancel`` and ``consumed``.
    """

    _standing: Standing
    _done: bool  # set by each subclass (no class default: a half-built iterator's __del__ looks for it)
    _cancelled: str | None
    _epoch_set: int | None = None  # what this iteration set ``_standing.epoch`` to last (None: nothing yet)

    def _attach(self, context: IterationContext) -> None:
        """Take the context and its ``Standing``. The context keeps the engine alive (the Loader
        ends it when its context is garbage), so that ``for batch in Loader(...)`` works; the
        iterator holds no reference to its Loader, which holds it: no cycle keeps an abandoned
        loader's workers and shared memory alive until the garbage collector runs."""
        self._context = context
        self._standing = context.standing

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Restart at ``initial_state`` (a position: ``get_state()``, or the position part of a
        ``Loader.state_dict()``), or with ``None`` at the start of ``loader.epoch``, as a new
        ``iter(loader)`` would. Raises ``ValueError`` for a corrupt position (nothing is changed)."""
        context = self._context
        if initial_state is None:
            epoch = self._standing.epoch
            initial_state = start_position(context.order, epoch, context.default_until(epoch))
        resume = decode_position(initial_state, context.order)
        self._halt()
        self._epoch_set = None  # this iteration decides where the loader stands, as a new iter() does
        self._start(resume.epoch, resume.done, resume.until_or(context.default_until(resume.epoch)), resume.ahead)

    def get_state(self) -> dict[str, Any]:
        """Where the consumer stands, to resume exactly there (the position ``Loader.state_dict``
        saves). Once every batch was returned: the start of the next iteration (the epoch after
        this one's last, spanning the loader's ``epochs``), as the Loader's next ``iter()``."""
        order = self._context.order
        point = self._point()
        if point is None:
            start = self._next_start()
            return start_position(order, start, self._context.default_until(start))
        return encode_position(order, point)

    def _start(self, number: int, done: Any, until: int | None, ahead: dict[int, Any]) -> None:
        """Begin the iteration at epoch ``number`` (``done``, ``ahead``: what was returned already,
        decoded; ``until``: the epoch it stops before, None: never)."""
        raise NotImplementedError

    def _halt(self) -> None:
        """End the running iteration, if any, before a ``reset`` starts another."""
        raise NotImplementedError

    def _point(self) -> ResumePoint | None:
        """Where the consumer stands, in the form ``Epoch.consumer_progress()`` gives; None once
        every batch of the iteration was returned."""
        raise NotImplementedError

    def _next_start(self) -> int:
        """The epoch the next iteration starts at, once every batch of this one was returned."""
        raise NotImplementedError

    def _begin(self, iteration: Iteration, number: int) -> None:
        """What every ``_start`` does once its ``iteration`` is made: the consumer is in its first
        epoch (``number``), nothing has ended, been cancelled or failed yet, ``stats()`` shows
        that epoch's counters and ``loader.epoch`` moves past it."""
        self._iteration = iteration
        self._epoch = iteration.first
        self.number = number
        self._done = False
        self._complete = False  # every batch of the iteration was returned
        self._cancelled = None
        self._failed: BaseException | None = None  # what ended the iteration, raised by a next() already
        self._told: set[int] = set()  # the threads a next() has told why the iteration ended (_over)
        self._standing.counters = self._epoch.counters
        self._set_epoch(number + 1)

    def _ending(self, exc: BaseException) -> BaseException:
        """The error that ends the iteration, for the ``next()`` that met it to raise: later ones
        in this thread find the iteration over (``_over``)."""
        self._failed = exc
        self._told.add(threading.get_ident())
        return exc

    def _ended_early(self) -> NoReturn:
        """A ``next()`` that finds the iteration cancelled (``iter()``, ``load_state_dict`` or
        ``close()`` elsewhere): it says so; later ones in this thread find it over."""
        self._told.add(threading.get_ident())
        iteration_over(self._cancelled)

    def _over(self) -> NoReturn:
        """``next()`` on an iteration that has ended. Each thread is told once why, if it did not
        end with its last batch: the error that ended it (a ``RuntimeError`` from it: the error
        itself was raised by the ``next()`` that met it, perhaps in another thread), or that it
        was ended early. After that, and after a normal end, it is exhausted: ``StopIteration``.
        So a loop that catches an error and calls ``next()`` again ends instead of spinning, and
        no thread sees an iteration that ended early end as if it were complete."""
        thread = threading.get_ident()
        if thread not in self._told:
            self._told.add(thread)
            if self._failed is not None:
                raise RuntimeError(
                    "this epoch's iterator has already ended with an error, raised by an earlier next() in "
                    "another thread; iter(loader) starts a new epoch"
                ) from self._failed
            if self._cancelled:
                iteration_over(self._cancelled)
        raise StopIteration

    def _set_epoch(self, epoch: int) -> None:
        """Move ``loader.epoch`` along (unless the user chose one with ``set_epoch`` meanwhile)."""
        self._epoch_set = self._standing.advance(self._epoch_set, epoch)

    def owns_epoch(self) -> bool:
        """``loader.epoch`` is still what this iteration made it (for ``state_dict``)."""
        return self._standing.set_by(self._epoch_set)

    @property
    def cancelled(self) -> str | None:
        """Why this iteration was cancelled early, or None; a stage reading the iterator in
        another thread (torch/device.py) stops on it."""
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

    def cancel(self, why: str) -> None:
        """End this iteration early (``why`` is what its next ``next()`` says)."""
        raise NotImplementedError


@dataclass(frozen=True)
class IterationContext:
    """Everything an epoch iterator needs from its Loader, built once by the Loader.

    ``order``: the batches of each epoch (``index_order.IndexOrder``, ``index_order.CallerOrder``,
    or ``_sources.stream.ShardOrder``); ``spec``: what the workers run (also used in the calling
    process with ``workers=0``); ``coordinator``: None with ``workers=0``; ``epochs``: the
    epochs one iteration spans (None: endless).
    """

    order: Any
    spec: WorkerSpec
    ordered: bool
    with_epoch: bool
    max_skipped: int | float
    coordinator: Coordinator | None
    epochs: int | None = 1
    standing: Standing = field(default_factory=Standing)
    rotation: int = 0  # assign="round_robin": batch k goes to worker k % rotation (0: any worker)

    def default_until(self, start: int) -> int | None:
        """The epoch an iteration starting at ``start`` stops before, by the loader's ``epochs``."""
        return None if self.epochs is None else start + self.epochs
