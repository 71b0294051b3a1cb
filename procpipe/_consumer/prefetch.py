"""A function over each batch of a node: inline (``Mapped``) or ahead, in a thread (``Prefetcher``).

These two nodes (procpipe/_consumer/nodes.py) need nothing but the standard library: the torch
device stage (procpipe/torch/device.py) is built from them with its own functions, in
the manner of torchdata's nodes, where ``Prefetcher`` and ``PinMemory`` are one threaded
mapper given two functions.

- ``Mapped(source, fn)``: ``fn(batch)`` in the consumer's thread, at ``next()`` (``device="cpu"``:
  numpy to tensors, then ``device_fn``).
- ``Prefetcher(source, fn, depth)``: a background thread takes batches from ``source`` up to
  ``depth`` ahead of the consumer and runs ``fn`` on each there (``device="cuda"``: the copy to
  the GPU; the torch facade's ``pin_memory`` and ``timeout``). ``fn(batch)`` returns
  ``(batch, ready)``; ``ready()``, if not None, runs in the consumer's thread just before the
  batch is returned (a CUDA stream wait, for instance).

Neither has a state of its own: ``get_state()`` is the source's position. ``Mapped`` passes it
through; ``Prefetcher``'s thread takes the source's ``get_state()`` right after each ``next()``
and sends it with the batch, and the node reports the state that came with the batch it
returned last, so ``Loader.state_dict()`` never counts the batches the thread holds as
returned.

The thread talks to the consumer through one queue of small typed items, one class per
meaning: ``_Batch`` (a batch, its ``ready`` and the source's state), ``_Ended`` (the source is
exhausted) and ``_Raised`` (an exception to raise in the consumer).
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from .._core.deferred_interrupt import raise_deferred
from .._engine.epochs import iteration_over
from .._worker import fork_safety
from .nodes import Node

__all__ = ["Mapped", "Prefetcher"]

_ABANDON_CHECK_S = 0.25  # how often a thread blocked on a full queue checks it is still wanted

#: ``fn`` of a ``Prefetcher``: a batch -> ``(batch, ready)``, ``ready`` None or run by the consumer.
Transfer = Callable[[Any], "tuple[Any, Callable[[], None] | None]"]


# --------------------------------------------------------------------------- queue items
class _Batch:
    """Queue item: a batch for the consumer, ``ready`` (None, or run by the consumer before it
    returns the batch) and ``state``: the source's ``get_state()`` once it had given the batch."""

    __slots__ = ("batch", "ready", "state")

    def __init__(self, batch: Any, ready: Callable[[], None] | None, state: dict | None) -> None:
        self.batch = batch
        self.ready = ready
        self.state = state


class _Ended:
    """Queue item: the source is exhausted (``state``: None, the state of the last batch stands)."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = None


class _Raised:
    """Queue item: an exception for the consumer; ``final``: the thread stopped after it;
    ``state``: the source's, past the failed batch (None: unchanged)."""

    __slots__ = ("exc", "final", "state")

    def __init__(self, exc: BaseException, final: bool = True, state: dict | None = None) -> None:
        self.exc = exc
        self.final = final
        self.state = state


_Item = _Batch | _Ended | _Raised


def _no_state() -> None:
    return None


# --------------------------------------------------------------------------- the thread
def _stage_main(
    source: Iterator,
    transfer: Transfer,
    out: queue.Queue,
    stop: threading.Event,
    requests: queue.SimpleQueue | None,
    snapshot: Callable[[], dict | None],
) -> None:
    """The prefetching thread: one item per batch of ``source`` into ``out``, each with the
    source's ``get_state()`` right after ``next()`` gave the batch (what the consumer will have
    had once the node returns it). With ``requests``, it fetches one batch per request."""
    try:
        while not stop.is_set():
            if requests is not None and requests.get() is None:
                return
            item: _Item
            try:
                batch = next(source)
            except StopIteration:
                _offer(out, _Ended(), stop, source)
                return
            except Exception as exc:  # noqa: BLE001 - this batch failed: raised in the consumer, then
                item = _Raised(exc, False, snapshot())  # the next one follows (the source says)
            else:
                state = snapshot()
                try:
                    with fork_safety.native_region():  # a CUDA copy may hold the driver's locks: no fork now
                        item = _Batch(*transfer(batch), state)
                except Exception as exc:  # noqa: BLE001 - as above: this batch's error
                    item = _Raised(exc, False, state)
                del batch  # (a ring slot is free once the transfer no longer needs it)
            if not _offer(out, item, stop, source):
                return
            del item
    except BaseException as exc:  # noqa: BLE001 - delivered to the consumer, raised there
        _offer(out, _Raised(exc), stop, source)


def _offer(out: queue.Queue, item: _Item, stop: threading.Event, source: Iterator) -> bool:
    """Put ``item`` for the consumer; False (item dropped) once nobody will take it: ``close()``
    or a new epoch cancelled this one while the queue was full."""
    while True:
        try:
            out.put(item, timeout=_ABANDON_CHECK_S)
            return True
        except queue.Full:  # the consumer is busy, or gone
            if stop.is_set() or getattr(source, "cancelled", None):
                return False


class Prefetcher(Node):
    """A background thread between a source node and the consumer: a node over ``source``.

    ``transfer(batch) -> (batch, ready)`` runs in the thread; ``ready()`` (if not None)
    runs in the consumer's thread just before the batch is returned (e.g. to make the
    consumer's CUDA stream wait for the copy). The thread holds up to ``depth`` batches
    ahead; with ``depth=0`` it fetches only when asked (used for ``timeout``: ``next()``
    raises ``RuntimeError`` after ``timeout`` seconds without a batch), holding none.

    The thread runs ahead of the consumer, so the source's own state counts the batches
    the node holds as returned. The thread therefore keeps the source's ``get_state()``,
    taken right after each ``next()``, with the batch; the node's ``get_state()`` is that
    of the batch it returned last (before any: the source's when the thread started). It
    has no state of its own: its state is the source's position, passed through. A source
    without ``get_state`` (the torch facade's in-process iterable), or ``keep_state=False``
    (the facade, which has no ``state_dict``: no snapshot per batch), gives a node without one.

    The source may also have ``cancelled`` (a reason, once something ended its iteration
    early: the thread then stops) and ``cancel(reason)`` (``close()`` calls it, to wake a
    thread waiting in the source's ``next()``).
    """

    _JOIN_S = 60.0  # the most reset() waits for the old thread to stop
    _CLOSE_JOIN_S = 10.0  # the most close() waits for it (then warns and leaves it)

    def __init__(
        self, source: Iterator, transfer: Transfer, depth: int, timeout: float | None = None, *, keep_state: bool = True
    ) -> None:
        self._source = source
        self._keep_state = keep_state
        self._transfer = transfer
        self._depth = depth
        self._timeout = timeout or None
        self._begin()

    def _begin(self) -> None:
        """Start the thread over the source as it stands now."""
        source_state = getattr(self._source, "get_state", None) if self._keep_state else None
        self._snapshot = _no_state if source_state is None else source_state
        self._state: dict | None = self._snapshot()  # the source's, for the batches returned so far
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=max(self._depth, 1))
        self._stop = threading.Event()
        self._requests: queue.SimpleQueue | None = queue.SimpleQueue() if self._depth == 0 else None
        self._pending = False
        self._finished = False
        args = (self._source, self._transfer, self._queue, self._stop, self._requests, self._snapshot)
        if getattr(self._source, "runs_user_code", False):  # workers=0: the user's fn runs in this thread,
            self._thread = threading.Thread(
                target=_stage_main,
                args=args,  # which is then theirs, not
                name="procpipe-device-stage",
                daemon=True,
            )  # procpipe's (fork_safety)
            self._thread.start()
        else:
            self._thread = fork_safety.start_thread(_stage_main, "procpipe-device-stage", args)

    def __next__(self) -> Any:
        raise_deferred()  # a Ctrl-C that landed as a batch died (deferred_interrupt.py)
        if self._finished:
            raise StopIteration
        if self._requests is not None and not self._pending:
            self._requests.put(True)
            self._pending = True
        item = self._get()
        self._pending = False
        if type(item) is _Batch:  # the common case first
            if item.state is not None:
                self._state = item.state
            if item.ready is not None:
                item.ready()
            return item.batch
        if item.state is not None:
            self._state = item.state
        if type(item) is _Raised:
            self._finished = item.final
            raise item.exc
        self._finished = True  # _Ended
        iteration_over(getattr(self._source, "cancelled", None))

    def get_state(self) -> dict[str, Any]:
        """The source's state when it gave the batch returned last (the batches held ahead are not
        counted); before any, the source's when the thread started."""
        if self._state is None:
            raise TypeError(
                f"this stage keeps no state (keep_state=False, or its source, a "
                f"{type(self._source).__name__}, has no get_state())"
            )
        return self._state

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Stop the thread (dropping the batches it holds), reset the source at ``initial_state``,
        and start again."""
        self._signal_stop()
        self._thread.join(self._JOIN_S)
        if self._thread.is_alive():
            raise RuntimeError(
                f"procpipe's device stage thread did not stop within {self._JOIN_S:.0f} s "
                "(the source's next() has not returned)"
            )
        reset = getattr(self._source, "reset", None)
        if reset is None:
            raise TypeError(f"this stage cannot restart: its source, a {type(self._source).__name__}, has no reset()")
        reset(initial_state)
        self._begin()

    def _get(self) -> _Item:
        if self._timeout is not None:
            try:
                return self._queue.get(timeout=self._timeout)
            except queue.Empty:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds") from None
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    if getattr(self._source, "cancelled", None):
                        return _Ended()  # abandoned: a new epoch or close() cancelled the epoch under us
                    return _Raised(RuntimeError("procpipe's device stage thread stopped unexpectedly"))

    def close(self) -> None:
        """Stop the thread and wait (at most ``_CLOSE_JOIN_S``) until it has: batches it holds are
        dropped (their slots return to the ring), and no copy or user code of this stage still
        runs when the loader's memory is released or the interpreter exits (a daemon thread
        inside a library's C++ code then aborts the process, as JAX's does)."""
        self._signal_stop()
        thread = self._thread
        if thread is threading.current_thread() or not thread.is_alive():
            return
        thread.join(self._CLOSE_JOIN_S)
        if thread.is_alive():
            warnings.warn(
                f"procpipe's device stage thread has not stopped {self._CLOSE_JOIN_S:.0f} s after close(): "
                "its transfer function or the dataset's code (workers=0) has not returned; it is left running",
                RuntimeWarning,
                stacklevel=2,
            )

    def _signal_stop(self) -> None:
        """Tell the thread to stop and wake it, without waiting for it."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._finished = True
        if self._requests is not None:
            self._requests.put(None)
        cancel = getattr(self._source, "cancel", None)
        if cancel is not None:
            cancel("the iterator was closed")  # wakes the thread if it waits for a batch
        while True:
            try:
                self._queue.get_nowait()  # unblocks a put
            except queue.Empty:
                break

    def __del__(self) -> None:
        try:
            self._signal_stop()  # no wait: a collection may run in any thread, this one's included
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


class Mapped(Node):
    """``fn`` applied to each batch of ``source``, in the consumer's thread (``device="cpu"``).

    It has no state of its own: ``get_state``/``reset`` are its source's (passed through)."""

    def __init__(self, source: Node, fn: Callable[[Any], Any]) -> None:
        self._source = source
        self._fn = fn

    def __next__(self) -> Any:
        return self._fn(next(self._source))

    def get_state(self) -> dict[str, Any]:
        return self._source.get_state()

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        self._source.reset(initial_state)

    def close(self) -> None:
        close = getattr(self._source, "close", None)  # (a plain iterator under it has none)
        if close is not None:
            close()
