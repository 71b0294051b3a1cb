"""The consumer's side of one ``iter(loader)``: the iterator ``next()`` is called on.

Where it sits in the data path: coordinator -> worker -> ring slot -> reassembly ->
**epoch iterator** -> prefetch/device stage (``Loader(device=...)``, torch/device.py) ->
consumer. With workers, ``EpochIterator`` reads the batches of an ``Iteration`` (epochs.py)
from the one queue the coordinator thread fills through each epoch's reassembly (in
order or as they finish) and tells the coordinator of each batch the consumer took.
With ``workers=0`` the Loader uses ``inline.InlineDriver`` instead, which drives the same
``Iteration`` and epochs in the calling thread, so the results are identical.

Both are given what they need by the Loader (an ``iteration_context.IterationContext``, built
once), keep where the loader stands current (``iteration_context.Standing``: ``loader.epoch`` and
the counters ``loader.stats()`` shows), and are source nodes (procpipe/_consumer/nodes.py):
``get_state()`` says where the consumer stands (``Loader.state_dict``), ``reset(state)``
restarts there (``load_state_dict`` then ``iter()``).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, cast

from .._core.deferred_interrupt import raise_deferred
from .._core.reassembly import ResumePoint
from .._engine.commands import CancelIteration, StartIteration
from .._engine.epochs import EndOfIteration, Epoch, EpochEnd, Failure, Iteration
from .iteration_context import IterationContext, LoaderIterator

if TYPE_CHECKING:
    from .._engine.coordinator import Coordinator

_generations = itertools.count()
_CONSUMER_POLL_S = 1.0  # how often a waiting consumer checks that the coordinator is alive


class EpochIterator(LoaderIterator):
    """One ``iter(loader)`` with workers: the epochs of an ``Iteration``, read from its one queue.

    ``position`` is ``(epoch, position in the epoch)`` of the batch ``next()`` returned last.

    Items are ``(epoch, position, batch)``; an ``EpochEnd`` marker follows each epoch's
    last batch, ``EndOfIteration`` the iteration's. ``number`` is the latest epoch the consumer
    has entered (whose counters ``stats()`` shows); ``_low`` the oldest it is not past.
    """

    def __init__(self, context: IterationContext, initial_state: dict[str, Any] | None = None) -> None:
        self._attach(context)
        self._coordinator = cast("Coordinator", context.coordinator)  # (with workers there is one)
        self._with_epoch = context.with_epoch
        self._lock = threading.Lock()  # one next() at a time (threads may share the iterator)
        self._done = True  # no iteration yet (reset starts one)
        self.reset(initial_state)

    def _start(self, number: int, done: frozenset, until: int | None, ahead: dict[int, frozenset]) -> None:
        context = self._context
        iteration = Iteration(
            next(_generations),
            context.order,
            number,
            until,
            context.ordered,
            context.order.batches(number),
            done,
            ahead,
            rotation=context.rotation,
        )
        self.batch_count = len(iteration.first.batches)
        self._low = number
        self._ended: set[int] = set()  # epochs at or above _low whose EpochEnd the consumer has seen
        self._begin(iteration, number)  # (the consumer is in the iteration's first epoch)
        self._coordinator.submit(StartIteration(iteration))

    def _halt(self) -> None:
        if not self._done:
            self._done = True
            self._coordinator.submit(CancelIteration(self._iteration.gen))

    def __iter__(self) -> EpochIterator:
        return self

    @property
    def consumed(self) -> int | None:
        return self._epoch.consumed

    def __next__(self) -> Any:
        # Threads sharing the iterator take batches in turn, and each sees its end: the
        # StopIteration, or the error (the one that ended it, or a RuntimeError saying so).
        with self._lock:
            return self._next()

    def _next(self) -> Any:
        raise_deferred()  # a Ctrl-C that landed as the previous batch died (deferred_interrupt.py)
        if self._done:
            self._over()
        iteration = self._iteration
        started = time.perf_counter()
        while True:
            item = self._get()
            if type(item) is tuple:
                epoch, seq, batch = item
                waited = time.perf_counter() - started
                epoch.counters.wait_s += waited
                iteration.wait_s += waited
                self._coordinator.consumed_one(iteration, epoch, seq)
                self.position = (epoch.number, seq)  # device_fn's batch_rng() key (torch_device)
                if epoch.number > self.number:
                    self._enter(epoch)
                if type(batch) is Failure:  # this batch's user code raised; the next one follows
                    raise batch.exc
                return (epoch.number, batch) if self._with_epoch else batch
            if isinstance(item, EpochEnd):
                self._epoch_end(item.epoch)
                continue
            now = time.perf_counter()
            self._epoch.counters.wait_s += now - started
            iteration.wait_s += now - started
            self._done = True
            if item is EndOfIteration:
                self._epoch.counters.ended = now  # the consumer's end of the epoch (stats)
                # Cancelled (iter() or close() from another thread or a signal handler) while
                # this next() waited: the iteration ended early, so it must say so.
                if self._cancelled:
                    self._ended_early()
                self._complete = True
                self._set_epoch(self._next_start())
                raise StopIteration
            raise self._ending(item.exc)  # a Failure: the iteration ends with it

    def _enter(self, epoch: Epoch) -> None:
        """The consumer received the first batch of a later epoch."""
        self.number = epoch.number
        self._epoch = epoch
        self.batch_count = len(epoch.batches)
        self._standing.counters = epoch.counters
        self._set_epoch(epoch.number + 1)

    def _epoch_end(self, epoch: Epoch) -> None:
        now = time.perf_counter()
        epoch.counters.ended = now  # the consumer's end of that epoch
        following = self._iteration.opened.get(epoch.number + 1)
        if following is not None and following.consumed == 0:
            following.counters.started = now  # its time, for stats, starts where this one's ends
        self._ended.add(epoch.number)
        while self._low in self._ended:
            self._ended.discard(self._low)
            self._iteration.opened.pop(self._low, None)
            self._low += 1

    def _get(self) -> Any:
        out = self._iteration.out
        while True:
            try:
                return out.get(timeout=_CONSUMER_POLL_S)
            except queue.Empty:
                if not self._coordinator.is_alive():
                    try:  # what it put last, between the wait's timeout and this look (its failure)
                        return out.get_nowait()
                    except queue.Empty:
                        return Failure(RuntimeError("procpipe's coordinator thread has stopped; the loader was closed"))

    def _point(self) -> ResumePoint | None:
        """See ``Iteration.resume_point``: from the oldest epoch the consumer is not past."""
        if self._complete:
            return None
        return self._iteration.resume_point(self._low)

    def _next_start(self) -> int:
        iteration = self._iteration
        return iteration.until if iteration.until is not None else iteration.next_number

    def cancel(self, why: str) -> None:
        if not self._done:
            self._cancelled = why  # before _done: a next() in another thread that sees _done sees why
            self._done = True
            self._coordinator.submit(CancelIteration(self._iteration.gen))
            self._iteration.out.put(EndOfIteration)  # wakes a reader blocked in another thread (device stage)

    def __del__(self) -> None:
        if not self._done and self._coordinator is not None:
            try:
                self._coordinator.submit(CancelIteration(self._iteration.gen))
            except Exception:  # noqa: BLE001, S110 - interpreter teardown (modules already emptied): nothing to cancel
                pass
