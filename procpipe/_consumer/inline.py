"""``workers=0``: one source node for every source kind, driving the engine's own epochs in the calling thread.

With workers, the coordinator thread drives each epoch's plan (``_engine/epochs.py``:
the epoch's ``offers()``, ``take()``, the worker's ``produce``, the epoch's ``result()``) and the
consumer reads the iteration's queue. ``InlineDriver`` does the very same in ``next()``: when
the queue is empty it takes the plan's next task, produces it here (``_worker/produce.py``,
with the same per-sample scope and collation) and hands the result to the epoch; the plan
turns it into batches in their order (``IndexPlan`` for indexed sources, ``ShardPlan`` for
streams). So the output, the positions, ``state_dict``/resume, ``on_error="skip"``'s
budget and a batch's error are those of workers, for any kind, with no code per kind
here: like torchdata's nodes, inline and parallel are one node behind one plan.

The one thing a kind decides here is how a message names a sample and a task
(``SampleNames``, ``_sources/sample_names.py``: an indexed sample by its index, a stream's record by
``(shard, record)``), chosen with the source's kind.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .._core.notes import add_note
from .._core.reassembly import ResumePoint
from .._core.rng import SampleScope
from .._core.stats import array_bytes
from .._engine.epochs import EMPTY, EndOfIteration, Epoch, EpochEnd, Failure, Iteration
from .._sources.epoch_plan import loaded
from .._sources.sample_names import IndexNames, SampleNames
from .._worker.produce import produce
from ..errors import summarize_indices
from .iteration_context import IterationContext, LoaderIterator


class InlineDriver(LoaderIterator):
    """The ``workers=0`` source node (procpipe/_consumer/nodes.py) of any source kind: the engine's
    ``Iteration`` and epochs, driven in the calling thread.

    The iteration is ordered: the output is that of workers in the deterministic order (whatever
    ``ordered``). ``position`` is ``(epoch, position in the epoch)`` of the batch ``next()``
    returned last (``device_fn``'s ``batch_rng()`` key), as ``EpochIterator``'s.
    """

    position: tuple[int, int] | None = None
    runs_user_code = True  # the user's fn runs in the thread that iterates it (a device stage's: fork_safety)

    def __init__(
        self, context: IterationContext, initial_state: dict[str, Any] | None = None, names: SampleNames | None = None
    ) -> None:
        self._attach(context)
        self._lock = threading.Lock()  # one next() at a time (threads may share the iterator)
        self._spec = context.spec
        self._names: SampleNames = names if names is not None else IndexNames()
        self._scope = SampleScope(self._spec.seed, seed_globals=self._spec.seed_globals, restore_globals=True)
        self._with_epoch = context.with_epoch
        self._done = True  # no iteration yet (reset starts one)
        self.reset(initial_state)

    def _start(self, number: int, done: Any, until: int | None, ahead: dict[int, Any]) -> None:
        plan = self._context.order
        iteration = Iteration(-1, plan, number, until, True, plan.batches(number), done, ahead)
        if self._spec.skip:  # on_error="skip": each epoch's budget, as the coordinator sets it
            max_skipped = self._context.max_skipped

            def open_epoch(epoch: Epoch) -> None:
                epoch.skips = epoch.skip_budget(max_skipped)

            iteration.on_open = open_epoch
        iteration.open(iteration.first)
        self._producing: Epoch | None = None  # the epoch whose tasks _load takes
        self._begin(iteration, number)

    def _halt(self) -> None:
        if not self._done:
            self._stop()

    def __iter__(self) -> InlineDriver:
        return self

    def __next__(self) -> Any:
        with self._lock:
            return self._next()

    def _next(self) -> Any:
        if self._done:
            self._over()
        iteration = self._iteration
        started = time.perf_counter()
        out = iteration.out
        while True:
            while out.empty():  # (asked, not caught: an exception per batch costs more than the question)
                if self._cancelled:  # by iter() or close() from another thread or a signal handler
                    self._ended_early()
                try:
                    self._load()
                except BaseException as exc:  # (KeyboardInterrupt...): it ends the iteration (_over)
                    self._stop()
                    self._ending(exc)
                    raise
            item = out.get_nowait()
            if type(item) is tuple:
                epoch, seq, batch = item
                epoch.counters.wait_s += time.perf_counter() - started
                epoch.mark_consumed(seq)
                iteration.consumed += 1
                self.position = (epoch.number, seq)
                if epoch is not self._epoch:  # the first batch of the next epoch
                    self._enter(epoch)
                if type(batch) is Failure:  # this batch's user code raised; the next one follows
                    raise batch.exc
                return (epoch.number, batch) if self._with_epoch else batch
            if isinstance(item, EpochEnd):
                item.epoch.counters.ended = time.perf_counter()
                continue
            self._stop()
            if item is EndOfIteration:
                self._complete = True
                self._set_epoch(self._next_start())
                raise StopIteration
            raise self._ending(item.exc)  # a Failure that ends the iteration

    def _enter(self, epoch: Epoch) -> None:
        iteration = self._iteration
        for number in [n for n in iteration.opened if n < epoch.number]:
            del iteration.opened[number]  # past (resume_point starts at this epoch): let it go
        self._epoch, self.number = epoch, epoch.number
        self._standing.counters = epoch.counters
        self._set_epoch(epoch.number + 1)

    def _load(self) -> None:
        """Produce the task the open epoch needs next (opening the next epoch when one is done)."""
        epoch = self._producing  # (most often still the one producing: no need to look through the iteration)
        if epoch is None or not epoch.fresh:
            epoch = self._producing = self._iteration.fresh()
        if epoch is None:
            if self._iteration.out.empty():
                raise RuntimeError("procpipe: internal error: an epoch had nothing left to produce but did not end")
            return  # (opening the next epoch failed, or ended the iteration: the queue says so)
        offers = epoch.offers(1)
        if not offers:
            raise RuntimeError("procpipe: internal error: an epoch waits for no task but did not end")
        # An ordered stream's interleave waits for one block (the urgent offer); an index plan's next batch.
        offer = offers[0]
        if not offer.urgent:
            for other in offers:
                if other.urgent:
                    offer = other
                    break
        job = epoch.take(offer, -1)
        scope, skips = self._scope, epoch.skips
        try:
            produced = produce(self._spec, scope, epoch.number, job.payload, None, 0)
        except BaseException as exc:  # any type, as from a worker: the note, and the caller's generators back
            loading = scope.index
            scope.leave()
            if isinstance(exc, SystemExit):
                raise
            if skips is not None and skips.whole_batches and isinstance(exc, Exception):
                # on_error="skip": a batch whose collation failed is left out, within the budget
                if skips.add(job.payload, f"batch {job.seq} ({summarize_indices(job.payload)})", _failed(exc)):
                    epoch.result(job, EMPTY)
                    return
                add_note(exc, skips.note())
            add_note(
                exc,
                f"procpipe: raised in the calling process (workers=0) while {self._names.task(job, loading)} "
                f"(epoch {epoch.number}).",
            )
            if not isinstance(exc, Exception):  # KeyboardInterrupt and the like: the iteration stops here
                raise
            # As with workers: this batch raises and the next one follows; the plan decides
            # whether the epoch can go on (a stream's shard cannot be read past an error), and
            # with on_error="skip" an error not skipped ends it.
            epoch.result(job, Failure(exc, batch_only=skips is None))
            return
        for key, error in produced.skipped:  # (skips is set: on_error="skip" is what leaves samples out)
            assert skips is not None
            if not skips.add([key], self._names.sample(key, job), _describe(error)):
                add_note(error, skips.note())
                epoch.result(job, Failure(error))
                return
        layout = produced.layout
        if layout is None:  # on_error="skip" left out every sample of the task
            epoch.result(job, EMPTY)
            return
        epoch.counters.array_bytes += array_bytes(layout)
        epoch.result(job, loaded(layout, None, len(produced.skipped)))

    def _stop(self) -> None:
        self._done = True
        self._iteration.finish()
        self._spec.producer.close_readers()

    @property
    def consumed(self) -> int:
        return self._epoch.consumed

    def _point(self) -> ResumePoint | None:
        """``Iteration.resume_point``: the epochs come in order, so the oldest one the consumer is not
        past is the one it is in."""
        if self._complete:
            return None
        return self._iteration.resume_point(self._epoch.number)

    def _next_start(self) -> int:
        iteration = self._iteration
        return iteration.until if iteration.until is not None else iteration.next_number

    def cancel(self, why: str) -> None:
        if not self._done:
            self._cancelled = why
            self._stop()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self._spec.producer.close_readers()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"


def _failed(exc: BaseException) -> str:
    return f"collating it failed: {_describe(exc)}"


__all__ = ["InlineDriver"]
