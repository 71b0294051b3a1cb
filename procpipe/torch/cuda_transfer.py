"""Batches to a CUDA device: ring registration, pinned staging, streams (needs ``torch`` with CUDA).

``Loader(device="cuda[:N]")`` runs ``CudaTransfer`` in a ``Prefetcher`` thread
(procpipe/_consumer/prefetch.py): each batch is copied to the GPU with a non-blocking copy on the
transfer's own CUDA stream, straight from its ring slot, the ring being registered with
CUDA once (``RingPins``), the slot released once the copy's event has completed; or, where
registration fails, through reused pinned staging buffers (``_StagingPool``).
``device_fn`` then runs on the batch there. The consumer's stream waits on the event and
the tensors are ``record_stream``-ed to it (``_Ready``, run by the consumer just before it
returns the batch), so ``next()`` costs nothing when the pipeline keeps up.
"""

from __future__ import annotations

import collections
import copy
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from .._ext import ALIGN, ring_of
from .convert import apply_device_fn, to_torch

__all__ = ["CudaTransfer", "RingPins"]

_THREAD = threading.local()  # per thread: the CUDA stream a transfer made current there


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
            kind: Any = type(x)  # a Mapping class taking a dict (not every one does: TypeError)
            return kind(items)
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

    ring: Any  # procpipe._core.shm.Ring
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
        except Exception:  # noqa: BLE001, S110 - CUDA already torn down (interpreter exit)
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

    def __call__(
        self, batch: Any, convert: Callable[[Any], Any] = to_torch, position: tuple[int, int] | None = None
    ) -> tuple[Any, _Ready | None]:
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
            sources = _cpu_tensors(tensors)
            moved: list[torch.Tensor]
            keep: list[torch.Tensor] = []  # what the consumer's stream must be recorded on
            if not sources:
                out, moved, event = tensors, [], None
            else:
                direct = self._direct(sources, entry) if entry is not None else None
                if direct is None or entry is None:
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
            device_fn = self.device_fn
            if device_fn is not None:
                out, event = self._apply(device_fn, out, position)
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
        whole = entry.host[lo - base : hi - base].to(self.device, non_blocking=True)
        moved = []
        for t, (ptr, n) in zip(sources, spans, strict=True):
            if n:
                piece = whole[ptr - lo : ptr - lo + n]
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
        total = sum(-(-n // ALIGN) * ALIGN for n in sizes)  # each tensor aligned as in the ring
        buffer = self.pool.take(total)  # may wait for the copy that last read it
        staged, offset = [], 0
        for tensor, n in zip(sources, sizes, strict=True):
            view = buffer[offset : offset + n].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)  # host copy out of the ring (synchronous)
            staged.append(view)
            offset += -(-n // ALIGN) * ALIGN
        moved = [view.to(self.device, non_blocking=True) for view in staged]  # on our stream (_use_stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        self.pool.give(buffer, event)
        return moved, event

    def _apply(self, device_fn: Callable[[Any], Any], batch: Any, position: tuple[int, int] | None) -> tuple[Any, Any]:
        """``device_fn(batch)`` on the transfer's stream (made current by ``_use_stream``),
        ``batch_rng()`` seeded by the batch's position, and the event recorded after it."""
        if position is None:
            position = (0, self._count)
        self._count += 1
        out = apply_device_fn(device_fn, self.seed, position, batch)
        event = torch.cuda.Event()
        event.record(self.stream)
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
                except Exception:  # noqa: BLE001, S110 - CUDA already torn down
                    pass
            self.in_flight.clear()
            if self.pins is not None:
                self.pins.close()
                self.pins = None  # a batch still arriving (a stage thread ending) takes the staging path

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


def _cpu_tensors(x: Any) -> list[torch.Tensor]:
    """Every CPU tensor of ``x``, in the order ``_map_tensors`` visits (and replaces) them."""
    found: list[torch.Tensor] = []
    _map_tensors(x, found.append)
    return found


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
