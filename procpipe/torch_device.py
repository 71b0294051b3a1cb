"""The prefetch/device stage of ``Loader(device=...)`` (needs ``torch``).

Where it sits in the data path: coordinator -> worker -> ring slot -> reassembly ->
**prefetch/device stage** -> consumer. It takes each batch the epoch iterator yields
(numpy views of a ring slot) and hands the consumer torch tensors:

- ``"cpu"``: ``to_torch`` turns every numeric/bool numpy array of the batch into a
  tensor sharing its memory (no copy, no thread);
- ``"cuda[:N]"``: a background thread (``Stage``) copies each batch from the ring into
  reused pinned buffers (``_StagingPool``; the ring slot is free once that host copy is
  done) and from there to the GPU with non-blocking copies on its own CUDA stream
  (``CudaTransfer``); the consumer's stream waits on the copy's event and the tensors are
  ``record_stream``-ed to it (``_Ready``), so ``next()`` costs nothing when the pipeline
  keeps up.

``import procpipe`` never imports this module: ``procpipe.loader`` loads it only when a
``device`` is given. ``procpipe.torch.DataLoader`` uses the same thread for its
``device=``, ``pin_memory=True`` and ``timeout``.
"""
from __future__ import annotations

import collections
import copy
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from .epochs import iteration_over

__all__ = ["CudaTransfer", "Stage", "device_stage", "resolve_device", "to_torch"]

_ALIGN = 64  # byte alignment of each tensor inside a pinned staging buffer
_ABANDON_CHECK_S = 0.25  # how often a stage thread blocked on a full queue checks it is still wanted


# --------------------------------------------------------------------------- numpy -> tensors
def to_torch(batch: Any) -> Any:
    """Every numpy array (numeric or bool) of ``batch`` as a tensor sharing its memory.

    Containers (dict, list, tuple, namedtuple) keep their type; other leaves (strings,
    objects, arrays of str) are left as they are. This is ``Loader(device="cpu")``.
    """
    kind = type(batch)
    if kind is np.ndarray:
        return torch.from_numpy(batch) if batch.dtype.kind in "biufc" else batch
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


def _stage_main(source: Iterator, transfer: Callable, out: queue.Queue, stop: threading.Event,
                requests: queue.SimpleQueue | None) -> None:
    try:
        while not stop.is_set():
            if requests is not None and requests.get() is None:
                return
            try:
                batch = next(source)
                item = transfer(batch)
                del batch  # the ring slot is free once the transfer no longer needs it
            except StopIteration:
                out.put(_End)
                return
            except Exception as exc:  # noqa: BLE001 - this batch failed: raised in the consumer, then
                batch = None  # the next one follows (the source says whether any does)
                item = _Raised(exc, final=False)
            while True:
                try:
                    out.put(item, timeout=_ABANDON_CHECK_S)
                    break
                except queue.Full:  # the consumer is busy, or gone: a new epoch or close() cancelled ours
                    if stop.is_set() or getattr(source, "_cancelled", None):
                        return
            del item
    except BaseException as exc:  # noqa: BLE001 - delivered to the consumer, raised there
        out.put(_Raised(exc))


class Stage:
    """A background thread between an epoch iterator and the consumer.

    ``transfer(batch) -> (batch, ready)`` runs in the thread; ``ready()`` (if not None)
    runs in the consumer's thread just before the batch is returned (e.g. to make the
    consumer's CUDA stream wait for the copy). With ``depth=0`` the thread fetches only
    when asked (used for ``timeout``), holding no batch of its own.
    """

    def __init__(self, source: Iterator, transfer: Callable, depth: int, timeout: float | None = None) -> None:
        self._source = source
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._requests: queue.SimpleQueue | None = queue.SimpleQueue() if depth == 0 else None
        self._pending = False
        self._timeout = timeout or None
        self._finished = False
        self._thread = threading.Thread(
            target=_stage_main, args=(source, transfer, self._queue, self._stop, self._requests),
            name="procpipe-device-stage", daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> Stage:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if self._requests is not None and not self._pending:
            self._requests.put(True)
            self._pending = True
        item = self._get()
        self._pending = False
        if item is _End:
            self._finished = True
            iteration_over(getattr(self._source, "_cancelled", None))
        if isinstance(item, _Raised):
            self._finished = item.final
            raise item.exc
        batch, ready = item
        if ready is not None:
            ready()
        return batch

    def _get(self) -> Any:
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
                    if getattr(self._source, "_cancelled", None):
                        return _End  # abandoned: a new epoch or close() cancelled the epoch under us
                    return _Raised(RuntimeError("procpipe's device stage thread stopped unexpectedly"))

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


class _Mapped:
    """``fn`` applied to each batch, in the consumer's thread (``device="cpu"``)."""

    def __init__(self, source: Iterator, fn: Callable) -> None:
        self._source = source
        self._fn = fn

    def __iter__(self) -> _Mapped:
        return self

    def __next__(self) -> Any:
        return self._fn(next(self._source))


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
            fits = [b for b in self.free if b.numel() >= nbytes]
            if fits:
                buffer = min(fits, key=lambda b: b.numel())
                self.free.remove(buffer)
                return buffer
            if len(self.free) + len(self.busy) < self.capacity:
                self.allocations += 1
                return self._allocate(max(nbytes, 1))
            if self.free:  # all too small: drop the smallest, allocate a bigger one
                self.free.remove(min(self.free, key=lambda b: b.numel()))
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


class CudaTransfer:
    """Ring -> pinned staging buffer (CPU copy) -> device (non-blocking, own stream).

    The ring slot is released as soon as the host copy into the staging buffer is done
    (the batch's views are dropped on return); the staging buffer is reused only after
    the device copy that reads it has completed (its event).
    """

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.pool = _StagingPool(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True), capacity)
        self._lock = threading.Lock()  # two epochs' threads may overlap briefly

    def __call__(self, batch: Any) -> tuple[Any, _Ready | None]:
        sources: list[torch.Tensor] = []

        def collect(tensor: torch.Tensor) -> torch.Tensor:
            sources.append(tensor)
            return tensor

        _map_tensors(batch, collect)
        if not sources:
            return batch, None
        sizes = [t.numel() * t.element_size() for t in sources]
        total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
        with self._lock, torch.cuda.device(self.device):
            buffer = self.pool.take(total)  # may wait for the copy that last read it
            staged, offset = [], 0
            for tensor, n in zip(sources, sizes):
                view = buffer[offset:offset + n].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor)  # host copy out of the ring (synchronous)
                staged.append(view)
                offset += -(-n // _ALIGN) * _ALIGN
            with torch.cuda.stream(self.stream):  # allocations and copies on our own stream
                moved = [view.to(self.device, non_blocking=True) for view in staged]
                event = torch.cuda.Event()
                event.record(self.stream)
            self.pool.give(buffer, event)
        sources.clear()  # drop the ring views now, so the slot returns to the ring
        staged.clear()
        outputs = iter(moved)
        return _map_tensors(batch, lambda t: next(outputs)), _Ready(self.device, event, moved)


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


def device_stage(device: Any, prefetch: int) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """For ``Loader(device=...)``: validate ``device`` and return ``wrap(epoch_iterator)``."""
    resolved = resolve_device(device)
    if resolved.type == "cpu":
        return lambda it: _Mapped(it, to_torch)
    transfer = CudaTransfer(resolved, capacity=prefetch + 2)
    return lambda it: Stage(it, lambda batch: transfer(to_torch(batch)), depth=prefetch)
