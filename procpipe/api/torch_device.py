"""The prefetch/device stage of ``Loader(device=...)`` (needs ``torch``).

Where it sits in the data path: coordinator -> worker -> ring slot -> reassembly ->
**prefetch/device stage** -> consumer. It takes each batch the epoch iterator yields
(numpy views of a ring slot) and hands the consumer torch tensors:

- ``"cpu"``: ``to_torch`` turns every numeric/bool numpy array of the batch into a
  tensor sharing its memory (no copy, no thread);
- ``"cuda[:N]"``: a background thread (``Stage``) copies each batch to the GPU with a
  non-blocking copy on its own CUDA stream (``CudaTransfer``): straight from its ring
  slot, the ring being registered with CUDA once (``RingPins``), the slot released once
  the copy's event has completed; or, where registration fails, through reused pinned
  staging buffers (``_StagingPool``). ``device_fn`` then runs on the batch there. The
  consumer's stream waits on the event and the tensors are ``record_stream``-ed to it
  (``_Ready``), so ``next()`` costs nothing when the pipeline keeps up.

Both stages are nodes (procpipe/api/nodes.py) over the epoch iterator: ``Stage`` keeps the
iterator's ``get_state()`` with each batch its thread takes ahead and reports that of the
batch it returned last; ``Mapped`` (``"cpu"``) passes the iterator's state through. So
``Loader.state_dict()`` never counts the batches the stage holds as returned.

``import procpipe`` never imports this module: ``procpipe.loader`` loads it only when a
``device`` is given. ``procpipe.torch.DataLoader`` uses the same thread for its
``device=``, ``pin_memory=True`` and ``timeout``.
"""
from __future__ import annotations

import collections
import copy
import itertools
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from ..engine.epochs import iteration_over
from .nodes import Node
from ..core.rng import device_scope
from ..core.shm import ring_of
from ..worker import fork_safety

__all__ = ["CudaTransfer", "DeviceStage", "Mapped", "RingPins", "Stage", "device_stage", "resolve_device", "to_torch"]

_ALIGN = 64  # byte alignment of each tensor inside a pinned staging buffer
_THREAD = threading.local()  # per thread: the CUDA stream a transfer made current there
_ABANDON_CHECK_S = 0.25  # how often a stage thread blocked on a full queue checks it is still wanted


# --------------------------------------------------------------------------- numpy -> tensors
def to_torch(batch: Any) -> Any:
    """Every numpy array (numeric or bool) of ``batch`` as a tensor sharing its memory.

    Containers (dict, list, tuple, namedtuple) keep their type; other leaves (strings,
    objects, arrays of str) are left as they are. This is ``Loader(device="cpu")``. A
    read-only array (one that arrived through Ray's object store, procpipe.ray) is copied:
    a tensor cannot be read-only, and writing into the store's memory would corrupt it.
    """
    kind = type(batch)
    if kind is np.ndarray:
        if batch.dtype.kind not in "biufc":
            return batch
        return torch.from_numpy(batch if batch.flags.writeable else batch.copy())
    if kind is dict:
        return {k: to_torch(v) for k, v in batch.items()}
    if kind is list:
        return [to_torch(v) for v in batch]
    if kind is tuple:
        return tuple(to_torch(v) for v in batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return kind(*(to_torch(v) for v in batch))
    return batch


# --------------------------------------------------------------------------- the stage thread
class _End:
    """Queue marker: the epoch is over."""


class _Raised:
    """Queue item: an exception for the consumer; ``final``: the stage thread stopped after it."""

    def __init__(self, exc: BaseException, final: bool = True) -> None:
        self.exc = exc
        self.final = final


def _no_state() -> None:
    return None


def _stage_main(source: Iterator, transfer: Callable, out: queue.Queue, stop: threading.Event,
                requests: queue.SimpleQueue | None, snapshot: Callable[[], dict | None]) -> None:
    """The stage's thread: ``(item, state)`` pairs into ``out``, ``state`` being the source's
    ``get_state()`` right after ``next()`` gave the item (what the consumer will have had once
    the stage returns it)."""
    try:
        while not stop.is_set():
            if requests is not None and requests.get() is None:
                return
            try:
                batch = next(source)
            except StopIteration:
                out.put((_End, None))
                return
            except Exception as exc:  # noqa: BLE001 - this batch failed: raised in the consumer, then
                item, state = _Raised(exc, final=False), snapshot()  # the next one follows (the source says)
            else:
                state = snapshot()
                try:
                    with fork_safety.native_region():  # a CUDA copy may hold the driver's locks: no fork now
                        item = transfer(batch)
                except Exception as exc:  # noqa: BLE001 - as above: this batch's error
                    item = _Raised(exc, final=False)
                del batch  # the ring slot is free once the transfer no longer needs it
            while True:
                try:
                    out.put((item, state), timeout=_ABANDON_CHECK_S)
                    break
                except queue.Full:  # the consumer is busy, or gone: a new epoch or close() cancelled ours
                    if stop.is_set() or getattr(source, "cancelled", None):
                        return
            del item
    except BaseException as exc:  # noqa: BLE001 - delivered to the consumer, raised there
        out.put((_Raised(exc), None))


class Stage(Node):
    """A background thread between an epoch iterator and the consumer: a node over ``source``.

    ``transfer(batch) -> (batch, ready)`` runs in the thread; ``ready()`` (if not None)
    runs in the consumer's thread just before the batch is returned (e.g. to make the
    consumer's CUDA stream wait for the copy). With ``depth=0`` the thread fetches only
    when asked (used for ``timeout``), holding no batch of its own.

    The thread runs ahead of the consumer, so the source's own state counts the batches
    the stage holds as returned. The thread therefore keeps the source's ``get_state()``,
    taken right after each ``next()``, with the batch; the stage's ``get_state()`` is that
    of the batch it returned last (before any: the source's when the stage started). It
    has no state of its own: its state is the source's position, passed through. A source
    without ``get_state`` (the torch facade's in-process iterable), or ``keep_state=False``
    (the facade, which has no ``state_dict``: no snapshot per batch), gives a stage without one.
    """

    _JOIN_S = 60.0  # the most reset() waits for the old thread to stop

    def __init__(self, source: Iterator, transfer: Callable, depth: int, timeout: float | None = None, *,
                 keep_state: bool = True) -> None:
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
        self._queue: queue.Queue = queue.Queue(maxsize=max(self._depth, 1))
        self._stop = threading.Event()
        self._requests: queue.SimpleQueue | None = queue.SimpleQueue() if self._depth == 0 else None
        self._pending = False
        self._finished = False
        args = (self._source, self._transfer, self._queue, self._stop, self._requests, self._snapshot)
        if getattr(self._source, "runs_user_code", False):  # workers=0: the user's fn runs in this thread,
            self._thread = threading.Thread(target=_stage_main, args=args,  # which is then theirs, not
                                            name="procpipe-device-stage", daemon=True)  # procpipe's (fork_safety)
            self._thread.start()
        else:
            self._thread = fork_safety.start_thread(_stage_main, "procpipe-device-stage", args)

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if self._requests is not None and not self._pending:
            self._requests.put(True)
            self._pending = True
        item, state = self._get()
        self._pending = False
        if state is not None:
            self._state = state
        if item is _End:
            self._finished = True
            iteration_over(getattr(self._source, "cancelled", None))
        if isinstance(item, _Raised):
            self._finished = item.final
            raise item.exc
        batch, ready = item
        if ready is not None:
            ready()
        return batch

    def get_state(self) -> dict[str, Any]:
        """The source's state when it gave the batch returned last (the batches held ahead are not
        counted); before any, the source's when the stage started."""
        if self._state is None:
            raise TypeError(f"this stage keeps no state (keep_state=False, or its source, a "
                            f"{type(self._source).__name__}, has no get_state())")
        return self._state

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Stop the thread (dropping the batches it holds), reset the source at ``initial_state``,
        and start again."""
        self.close()
        self._thread.join(self._JOIN_S)
        if self._thread.is_alive():
            raise RuntimeError(f"procpipe's device stage thread did not stop within {self._JOIN_S:.0f} s "
                               "(the source's next() has not returned)")
        self._source.reset(initial_state)
        self._begin()

    def _get(self) -> tuple[Any, dict | None]:
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
                        return _End, None  # abandoned: a new epoch or close() cancelled the epoch under us
                    return _Raised(RuntimeError("procpipe's device stage thread stopped unexpectedly")), None

    def close(self) -> None:
        """Stop the thread; batches it holds are dropped (their slots return to the ring)."""
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
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class Mapped(Node):
    """``fn`` applied to each batch of ``source``, in the consumer's thread (``device="cpu"``).

    It has no state of its own: ``get_state``/``reset`` are its source's (passed through)."""

    def __init__(self, source: Iterator, fn: Callable) -> None:
        self._source = source
        self._fn = fn

    def __next__(self) -> Any:
        return self._fn(next(self._source))

    def get_state(self) -> dict[str, Any]:
        return self._source.get_state()

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        self._source.reset(initial_state)


# ---- CUDA ------------------------------------------------------------------------------
def _map_tensors(x: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``x`` with ``fn`` applied to every CPU tensor, containers rebuilt as torch's pin_memory does."""
    if isinstance(x, torch.Tensor):
        return fn(x) if x.device.type == "cpu" else x
    if isinstance(x, (str, bytes, np.ndarray)):
        return x
    if isinstance(x, Mapping):
        items = {k: _map_tensors(v, fn) for k, v in x.items()}
        if type(x) is dict:
            return items
        try:
            if isinstance(x, collections.abc.MutableMapping):
                clone = copy.copy(x)
                clone.update(items)
                return clone
            return type(x)(items)
        except TypeError:
            return items
    if isinstance(x, tuple):
        if hasattr(x, "_fields"):
            return type(x)(*(_map_tensors(v, fn) for v in x))
        return type(x)(_map_tensors(v, fn) for v in x)
    if isinstance(x, list):
        return [_map_tensors(v, fn) for v in x]
    return x


class _StagingPool:
    """Pinned host buffers for host-to-device copies, reused once the copy reading them is done.

    ``allocate(nbytes)`` makes a 1-D uint8 tensor; ``give(buffer, event)`` returns a buffer
    whose copy was recorded by ``event`` (``query()``/``synchronize()``). At most
    ``capacity`` buffers exist; when all are in use, ``take`` waits for the oldest copy.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor], capacity: int) -> None:
        self._allocate = allocate
        self.capacity = max(1, capacity)
        self.free: list[torch.Tensor] = []
        self.busy: collections.deque = collections.deque()
        self.allocations = 0

    def take(self, nbytes: int) -> torch.Tensor:
        while self.busy and self.busy[0][0].query():
            self.free.append(self.busy.popleft()[1])
        while True:
            fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
            if fits:  # (by position: list.remove would compare tensors elementwise)
                return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
            if len(self.free) + len(self.busy) < self.capacity:
                self.allocations += 1
                return self._allocate(max(nbytes, 1))
            if self.free:  # all too small: drop the smallest, allocate a bigger one
                self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].numel()))
                continue
            event, buffer = self.busy.popleft()
            event.synchronize()
            self.free.append(buffer)

    def give(self, buffer: torch.Tensor, event: Any) -> None:
        self.busy.append((event, buffer))


class _Ready:
    """Run by the consumer: its current stream waits for the copy; the tensors are marked used by it."""

    def __init__(self, device: torch.device, event: Any, tensors: list) -> None:
        self.device = device
        self.event = event
        self.tensors = tensors

    def __call__(self) -> None:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.event)
        for tensor in self.tensors:
            tensor.record_stream(stream)  # the allocator must not reuse them before `stream` is done


class _Pinned(NamedTuple):
    """A ring registered with CUDA (page-locked in place): copies read it at full speed."""

    ring: Any  # procpipe.core.shm.Ring
    exporter: Any  # keeps the ring mapped while registered (see Ring.exporter)
    host: torch.Tensor  # a uint8 tensor over the whole ring


class RingPins:
    """The rings this process registered with ``cudaHostRegister``, one registration per ring.

    Only the consumer's process registers (the device stage runs there). A ring is
    unregistered, before it can be unmapped, once it is retired (replaced by a larger
    one) or closed and no copy reads it any more (``release``), or when the transfer is
    closed. A ring that cannot be registered is remembered, and its batches take the
    staging path.
    """

    def __init__(self) -> None:
        self.pinned: dict[int, _Pinned] = {}  # id(ring) -> registration
        self.refused: weakref.WeakSet = weakref.WeakSet()  # rings CUDA would not register
        self.registrations = 0

    def find(self, ring: Any) -> _Pinned | None:
        """``ring``'s registration, registering it now if it has none (None: it cannot be)."""
        key = id(ring)
        entry = self.pinned.get(key)
        if entry is not None and entry.ring is ring:
            return entry
        if ring in self.refused or ring.retired or ring.closed:
            return None
        try:
            exporter = ring.exporter()
        except (BufferError, ValueError):  # closed meanwhile
            return None
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(ring.address, ring.nbytes, 0)) != 0:
            self.refused.add(ring)
            return None
        self.registrations += 1
        host = torch.frombuffer(exporter, dtype=torch.uint8)
        entry = self.pinned[key] = _Pinned(ring, exporter, host)
        return entry

    def release(self, busy: set[int]) -> None:
        """Unregister the rings that are retired or closed and not in ``busy`` (ids of rings a
        copy still reads)."""
        for key, entry in list(self.pinned.items()):
            if (entry.ring.retired or entry.ring.closed) and key not in busy:
                self._unregister(key)

    def close(self) -> None:
        for key in list(self.pinned):
            self._unregister(key)

    def _unregister(self, key: int) -> None:
        entry = self.pinned.pop(key)
        try:
            torch.cuda.cudart().cudaHostUnregister(entry.ring.address)
        except Exception:  # noqa: BLE001 - CUDA already torn down (interpreter exit)
            pass
        # The host tensor and the exporter go with the entry: the ring may now be unmapped.


class _Copy(NamedTuple):
    """A batch's copy in flight: the ring views it reads stay alive (their slot stays leased)
    until its event has completed."""

    event: Any
    keep: Any  # the batch's ring views (numpy and tensors): dropping them releases the slot
    ring: int  # id(ring) of the registration it reads, 0 for none (staging path)


class CudaTransfer:
    """Ring -> device, non-blocking, on the transfer's own CUDA stream.

    The fast path: the ring is registered with CUDA once (``RingPins``), so a batch is
    copied straight from its ring slot, in one copy of the slot's span (the arrays lie
    side by side in it), and the slot is released only once that copy's event has
    completed (``_Copy``; a slot is never reused while a copy reads it). The fallback
    (a ring that cannot be registered, or tensors outside the ring): ring -> pinned
    staging buffer (CPU copy; the ring views are dropped at once) -> device; the staging
    buffer is reused only after the device copy that reads it has completed.

    ``device_fn`` (``Loader(device_fn=...)``) then runs on the batch on the device, on the
    same stream, with ``batch_rng()`` seeded from ``(seed, epoch, batch position)``.
    """

    MAX_IN_FLIGHT = 2  # copies whose slots are held at once: more waits for the oldest
    SLOTS_HELD = MAX_IN_FLIGHT + 1  # ring slots a transfer's stage may hold (the ring needs that many more)

    def __init__(self, device: torch.device, capacity: int, device_fn: Callable | None = None, seed: int = 0) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.pool = _StagingPool(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True), capacity)
        self.pins: RingPins | None = RingPins()  # None once closed
        self.device_fn = device_fn
        self.seed = seed
        self.in_flight: collections.deque[_Copy] = collections.deque()
        self.direct_batches = 0  # batches copied straight from a registered ring
        self.staged_batches = 0  # batches that took the staging path
        self._count = 0  # batches seen (device_fn's position when the source has none)
        self._last_ring = 0  # id() of the ring of the last batch
        self._stale = False  # a registered ring may be retired: look for rings to unregister
        self._lock = threading.Lock()  # two epochs' threads may overlap briefly

    def __call__(self, batch: Any, convert: Callable[[Any], Any] = to_torch,
                 position: tuple[int, int] | None = None) -> tuple[Any, _Ready | None]:
        """``batch`` (numpy views of a ring slot) on the device, and what the consumer runs
        before using it. ``convert`` makes the tensors (views of the same memory);
        ``position`` is ``(epoch, seq)`` of the batch, which seeds ``device_fn``'s
        ``batch_rng()``."""
        with self._lock:
            self._use_stream()
            self._reap(block=False)
            entry = None
            pins = self.pins
            if pins is not None:
                ring = _ring_of_batch(batch)
                if ring is not None:
                    entry = pins.find(ring)
                    if id(ring) != self._last_ring:  # a new ring: an older one may be retired now
                        self._last_ring, self._stale = id(ring), True
            tensors = convert(batch)
            sources: list[torch.Tensor] = []
            _map_tensors(tensors, lambda t: sources.append(t) or t)
            keep: list[torch.Tensor] = []  # what the consumer's stream must be recorded on
            if not sources:
                out, moved, event = tensors, [], None
            else:
                direct = self._direct(sources, entry) if entry is not None else None
                if direct is None:
                    moved, event = self._staged(sources)
                    keep = moved
                    self.staged_batches += 1
                    self.in_flight.append(_Copy(event, None, 0))
                else:
                    moved, event, whole = direct
                    keep = [whole]  # every tensor of the batch is a view of it
                    self.direct_batches += 1
                    self.in_flight.append(_Copy(event, (batch, tensors, sources), id(entry.ring)))
                outputs = iter(moved)
                out = _map_tensors(tensors, lambda t: next(outputs))
            del batch, tensors, sources
            if self.device_fn is not None:
                out, event = self._apply(out, position)
                keep = []
                _collect_device(out, keep)
            if event is None:
                return out, None
            if len(self.in_flight) > self.MAX_IN_FLIGHT:
                self._reap(block=True)
            return out, _Ready(self.device, event, keep)

    def _use_stream(self) -> None:
        """Make the transfer's device and stream current in the calling (stage) thread, once per
        thread: copies, allocations and ``device_fn`` then run on the stream without the cost
        of entering ``torch.cuda.device``/``torch.cuda.stream`` contexts for every batch."""
        if getattr(_THREAD, "stream", None) is not self.stream:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)
            _THREAD.stream = self.stream

    def _direct(self, sources: list[torch.Tensor], entry: _Pinned) -> tuple[list, Any, torch.Tensor] | None:
        """One copy of the span of the slot the tensors lie in (on the transfer's stream, made
        current by ``_use_stream``): the tensors (views of one device buffer), the copy's
        event and that buffer; None if some tensor lies elsewhere."""
        base, end = entry.ring.address, entry.ring.address + entry.ring.nbytes
        spans = []
        for t in sources:
            n = t.numel() * t.element_size()
            ptr = t.data_ptr()
            if n and (not t.is_contiguous() or ptr < base or ptr + n > end):
                return None
            spans.append((ptr, n))
        used = [(p, n) for p, n in spans if n]
        if not used:
            return None
        lo = min(p for p, _ in used)
        hi = max(p + n for p, n in used)
        if hi - lo > entry.ring.slot_bytes:
            return None
        whole = entry.host[lo - base:hi - base].to(self.device, non_blocking=True)
        moved = []
        for t, (ptr, n) in zip(sources, spans):
            if n:
                piece = whole[ptr - lo:ptr - lo + n]
                if t.dtype != torch.uint8:
                    piece = piece.view(t.dtype)
                moved.append(piece.view(t.shape))
            else:
                moved.append(torch.empty(t.shape, dtype=t.dtype, device=self.device))
        event = torch.cuda.Event()
        event.record(self.stream)
        return moved, event, whole

    def _staged(self, sources: list[torch.Tensor]) -> tuple[list, Any]:
        sizes = [t.numel() * t.element_size() for t in sources]
        total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
        buffer = self.pool.take(total)  # may wait for the copy that last read it
        staged, offset = [], 0
        for tensor, n in zip(sources, sizes):
            view = buffer[offset:offset + n].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)  # host copy out of the ring (synchronous)
            staged.append(view)
            offset += -(-n // _ALIGN) * _ALIGN
        moved = [view.to(self.device, non_blocking=True) for view in staged]  # on our stream (_use_stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        self.pool.give(buffer, event)
        return moved, event

    def _apply(self, batch: Any, position: tuple[int, int] | None) -> tuple[Any, Any]:
        """``device_fn(batch)`` on the transfer's stream, ``batch_rng()`` seeded by the batch's position."""
        if position is None:
            position = (0, self._count)
        self._count += 1
        epoch, seq = position
        try:
            with device_scope(self.seed, epoch, seq):  # on the transfer's stream (_use_stream)
                out = self.device_fn(batch)
                event = torch.cuda.Event()
                event.record(self.stream)
        except Exception as exc:
            exc.add_note(f"procpipe: raised by device_fn on batch {seq} of epoch {epoch}.")
            raise
        return out, event

    def _reap(self, block: bool) -> None:
        """Drop the ring views of completed copies (their slots go back to the ring); with
        ``block``, first wait for the oldest copy. Then unregister rings no copy reads."""
        in_flight = self.in_flight
        if block and in_flight:
            in_flight[0].event.synchronize()
        while in_flight and in_flight[0].event.query():
            in_flight.popleft()
        pins = self.pins
        if self._stale and pins is not None:
            pins.release({c.ring for c in in_flight})
            self._stale = any(e.ring.retired or e.ring.closed for e in pins.pinned.values())

    def close(self) -> None:
        """Wait for the copies in flight, release their slots, unregister every ring."""
        with self._lock:
            for copy_ in self.in_flight:
                try:
                    copy_.event.synchronize()
                except Exception:  # noqa: BLE001 - CUDA already torn down
                    pass
            self.in_flight.clear()
            if self.pins is not None:
                self.pins.close()
                self.pins = None  # a batch still arriving (a stage thread ending) takes the staging path

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _ring_of_batch(batch: Any) -> Any:
    """The ring of the first numpy array of a (numpy) batch, if it lives in one."""
    kind = type(batch)
    if kind is np.ndarray:
        return ring_of(batch)
    if isinstance(batch, Mapping):
        values: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return None
    for v in values:
        ring = _ring_of_batch(v)
        if ring is not None:
            return ring
    return None


def _collect_device(x: Any, out: list) -> None:
    """Every tensor on a device in ``x`` (containers walked), appended to ``out``."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            out.append(x)
    elif isinstance(x, Mapping):
        for v in x.values():
            _collect_device(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _collect_device(v, out)


def resolve_device(device: Any) -> torch.device:
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device: {exc}") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device={device!r}: procpipe's device stage supports 'cpu' and 'cuda[:N]'")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise RuntimeError(
            f"device={device!r} needs CUDA, but torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"{build}). Use device='cpu' (tensors sharing the ring's memory) or device=None (numpy), "
            "or run where a GPU and a CUDA build of torch are available."
        )
    if resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    if resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return resolved


class DeviceStage:
    """``Loader(device=...)``'s stage, made once per loader: ``stage(epoch_iterator)`` wraps
    one iteration; ``close()`` (``Loader.close``) releases the CUDA registrations."""

    def __init__(self, device: torch.device, prefetch: int, device_fn: Callable | None, seed: int) -> None:
        self.device = device
        self.prefetch = prefetch
        self.device_fn = device_fn
        self.seed = seed
        self.transfer = (CudaTransfer(device, prefetch + 2, device_fn, seed) if device.type == "cuda" else None)
        # Ring slots the stage may hold while its copies read them (the ring gets that many more).
        self.slots_held = CudaTransfer.SLOTS_HELD if self.transfer is not None else 0

    def __call__(self, it: Iterator[Any]) -> Iterator[Any]:
        transfer = self.transfer
        if transfer is None:
            device_fn = self.device_fn
            if device_fn is None:
                return Mapped(it, to_torch)
            count = itertools.count()
            return Mapped(it, lambda b: _apply_cpu(device_fn, self.seed, _position(it, count), to_torch(b)))
        return Stage(it, lambda batch: transfer(batch, to_torch, getattr(it, "position", None)), depth=self.prefetch)

    def info(self) -> dict[str, int]:
        """``Loader.stats()["device"]``: how batches reached the device."""
        t = self.transfer
        if t is None:
            return {"direct_batches": 0, "staged_batches": 0, "registered_rings": 0, "registrations": 0}
        pins = t.pins
        return {"direct_batches": t.direct_batches, "staged_batches": t.staged_batches,
                "registered_rings": 0 if pins is None else len(pins.pinned),
                "registrations": 0 if pins is None else pins.registrations}

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()


def _position(it: Any, count: Iterator[int]) -> tuple[int, int]:
    """``(epoch, seq)`` of the batch ``it`` returned last; where the iterator does not say (a
    streaming source with ``workers=0``), ``(0, how many batches came before)``."""
    seq = next(count)
    return getattr(it, "position", None) or (0, seq)


def _apply_cpu(device_fn: Callable, seed: int, position: tuple[int, int], batch: Any) -> Any:
    """``device_fn`` on a CPU batch (``device="cpu"``), in the consumer's thread, seeded like on a GPU."""
    epoch, seq = position
    try:
        with device_scope(seed, epoch, seq):
            return device_fn(batch)
    except Exception as exc:
        exc.add_note(f"procpipe: raised by device_fn on batch {seq} of epoch {epoch}.")
        raise


def device_stage(device: Any, prefetch: int, device_fn: Callable | None = None, seed: int = 0) -> DeviceStage:
    """For ``Loader(device=...)``: validate ``device`` and return ``stage(epoch_iterator)``."""
    return DeviceStage(resolve_device(device), prefetch, device_fn, seed)
