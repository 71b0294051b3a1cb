"""The ring: fixed slots of shared memory that batches are collated into, its generations, and leases.

A ``Ring`` is a fixed number of equal slots in one shared-memory segment (shm.py: anonymous
memory, or a file in ``shm_dir``), made once the first batch tells the size of a full one. A
batch that does not fit its slot grows it: a new generation, with larger slots, replaces the
current one; the old one is *retired* and removed once all its slots have come back (the
consumer may still hold views of them). Slot numbers never repeat across generations, so
``ring_of(slot)`` finds the generation a slot belongs to. ``RingSet`` holds the generations and
their free lists, for the coordinator and a Ray agent; ``WorkerRings`` is a worker's view, the
segments it was sent (``MapRing``: each generation's descriptor arrives on its pipe before the
first task that names it).

A slot is handed to the consumer as a *lease*: a small per-batch object that exports the
slot's bytes. Every array of the batch is a view whose ``.base`` is that object, so the
slot goes back to the free list exactly when the last array of the batch dies (the lease's
``__del__``), never earlier.

Threads: ``take``, ``grow`` and ``remove_idle`` run on the thread (or under the lock) that
owns the rings: the coordinator's (_engine/coordinator.py), or a Ray agent's ring lock
(procpipe.ray.agent); ``release`` runs in whichever thread drops a batch's last view
(usually the consumer's), and wakes the coordinator if it said it was starved of slots.
"""

from __future__ import annotations

import ctypes
import mmap
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, cast

from ..errors import SharedMemoryError
from .deferred_interrupt import defer
from .memory_budget import format_bytes
from .shm import PAGE, Segments, close_fd, map_fd, room
from .stats import EpochCounters
from .wakeup import WakePipe

LARGE_RESERVATION_BYTES = 1 << 30  # a ring this large is mentioned when it is made


def is_large_reservation(needed: int, free: int) -> bool:
    """Whether reserving ``needed`` bytes where ``free`` are free deserves a word to the user:
    more than ``LARGE_RESERVATION_BYTES``, or more than a quarter of what is free."""
    return needed > LARGE_RESERVATION_BYTES or needed > free // 4


def round_slot_bytes(nbytes: int) -> int:
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


def warn_large_ring(directory: str | None, slots: int, slot_bytes: int, free: int) -> None:
    """Say (once per ring: a grown ring, a new generation, says it again) that the ring, just made,
    reserves a lot of memory (or of ``directory``), of the ``free`` bytes there were, and how to lower it."""
    needed = slots * slot_bytes
    if is_large_reservation(needed, free):
        where = "memory" if directory is None else directory
        warnings.warn(
            f"procpipe: the ring reserves {format_bytes(needed)} of {where} ({format_bytes(free)} was free): "
            f"{slots} slots of {format_bytes(slot_bytes)} (a full batch), one for each batch that may be ready or in "
            "flight at once (prefetch + 2*workers + 1, or prefetch + 4*workers + 1 for batches up to 1 MiB; "
            "plus workers with speculate=, and 3 with device='cuda'). "
            "To lower it: a smaller prefetch, fewer workers, or a smaller batch_size.",
            stacklevel=3,
        )


class Ring:
    """A fixed number of equal slots in one shared segment, and the consumer-side free list.

    A loader's ring can be replaced by a larger one (a *generation*: ``ring_id`` 0, 1, ...)
    when a batch outgrows its slots. Slot numbers are unique across generations: this
    ring's are ``first_slot .. first_slot + slots - 1``, so a slot number alone names its
    ring (``owns``). ``free`` holds the free slot numbers. A replaced ring is ``retired``:
    its slots are never handed out again, and it is removed once they are all back. ``fd``:
    its segment's descriptor (workers are sent it), open until the ring is closed.
    """

    def __init__(self, segments: Segments, ring_id: int, slots: int, slot_bytes: int, first_slot: int = 0) -> None:
        self.ring_id = ring_id
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.first_slot = first_slot
        self.retired = False
        self.closed = False
        self._segments = segments
        self.nbytes = slots * slot_bytes
        free_before, _ = room(segments.directory)
        self.fd = segments.new(f"ring{ring_id}", self.nbytes, f"{slots} ring slots of {format_bytes(slot_bytes)}")
        warn_large_ring(segments.directory, slots, slot_bytes, free_before)
        try:
            self._map: mmap.mmap | None = map_fd(self.fd, self.nbytes)
        except BaseException:
            close_fd(self.fd)
            segments.remove(f"ring{ring_id}")
            raise
        probe = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(probe)  # where the ring is mapped in this process (CUDA registration)
        del probe
        self.free: deque[int] = deque(range(first_slot, first_slot + slots))
        # One exporter type per ring: its length is the slot size; ``ring_ref`` finds the ring
        # from a batch. A weak reference: the ring holds the type, and a strong one back would
        # make a cycle that keeps a closed ring's mapping alive until the cycle collector runs.
        self._lease_type = cast(
            "type[ctypes.Array[ctypes.c_char]]",
            type(
                "SlotLease",
                (ctypes.Array,),
                {
                    "_type_": ctypes.c_char,
                    "_length_": slot_bytes,
                    "ring_ref": weakref.ref(self),
                    "__del__": _end_lease,
                },
            ),
        )

    def owns(self, slot: int) -> bool:
        return self.first_slot <= slot < self.first_slot + self.slots

    @property
    def idle(self) -> bool:
        """Every slot is free: nothing is being written into the ring or read from it."""
        return len(self.free) == self.slots

    def close(self) -> None:
        """Unmap the ring now and close its descriptor, unless a batch still uses it: then it is
        unmapped when the last such batch dies (the ring lets go of its mapping here, so only the
        batches' exporters hold it). Its memory goes once no process maps it or holds its descriptor."""
        self.closed = True
        if self.fd >= 0:
            close_fd(self.fd)
            self.fd = -1
        if self._map is None:
            return
        try:
            self._map.close()
        except BufferError:
            pass
        self._map = None

    def remove(self) -> None:
        """A retired ring whose slots are all back: its segment goes now (its memory once unmapped)."""
        self._segments.remove(f"ring{self.ring_id}")
        self.close()

    def lease(self, slot: int, on_release: Callable[[int], None]) -> ctypes.Array:
        """A per-batch object exporting slot ``slot``; ``on_release(slot)`` runs when it dies."""
        lease: Any = self._lease_type.from_buffer(self._mapped(), (slot - self.first_slot) * self.slot_bytes)
        lease.slot, lease.on_release = slot, on_release  # (_end_lease: half the cost of a weakref.finalize)
        return lease

    def exporter(self) -> ctypes.Array:
        """An object exporting the whole ring: while it lives the ring stays mapped (a CUDA
        registration holds one, so the memory is never unmapped while registered)."""
        return (ctypes.c_char * self.nbytes).from_buffer(self._mapped())

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            raise ValueError(f"ring {self.ring_id} is closed")
        return self._map


def _end_lease(lease: Any) -> None:
    """A slot lease's ``__del__``: the last array viewing the slot is gone, the slot goes back.

    A Ctrl-C whose handler runs in here is deferred to the loader's next step
    (deferred_interrupt.py): raised in a ``__del__``, it would be lost. (Landed before the
    slot was appended to its free list, it leaves the slot out of use, as a batch still held
    would: the iteration is being interrupted.)"""
    try:
        lease.on_release(lease.slot)
    except KeyboardInterrupt:
        defer()


def ring_of(array: Any) -> Ring | None:
    """The ring a numpy array of a batch lives in (a view of one of its slots), or None."""
    base = array
    for _ in range(8):
        base = getattr(base, "base", None)
        if base is None:
            return None
        ref = getattr(type(base), "ring_ref", None)
        ring = ref() if isinstance(ref, weakref.ref) else None
        if isinstance(ring, Ring):
            return ring
    return None


class WorkerRings:
    """A worker's view of the rings: the segment of each generation it was sent (``add``, from a
    ``MapRing`` message), mapped the first time a task names it.

    Tasks arrive in the order they were sent, and after the coordinator replaced its ring it
    names only the new one: a task naming a newer ring unmaps the older ones here (and closes
    the descriptors of those never mapped), so their memory goes once the coordinator is done
    with them too. One still exported (a view of it outlived its task, e.g. held by a traceback)
    is kept and tried again on every later call, so it is unmapped as soon as that view is gone.
    """

    def __init__(self) -> None:
        self._unmapped: dict[int, tuple[int, int]] = {}  # ring id -> (descriptor, bytes), not mapped yet
        self._maps: dict[int, mmap.mmap] = {}
        self._newest = -1

    def add(self, ring_id: int, fd: int, nbytes: int) -> None:
        """Ring ``ring_id``'s segment (``nbytes``) arrived as ``fd`` (this process now owns it)."""
        old = self._unmapped.pop(ring_id, None)
        if old is not None:
            close_fd(old[0])
        self._unmapped[ring_id] = (fd, nbytes)

    def slot(self, ring_id: int, slot: int, slot_bytes: int) -> memoryview:
        if ring_id > self._newest:
            self._newest = ring_id
        if len(self._maps) > 1 or len(self._unmapped) > 1 or (self._maps and ring_id not in self._maps):
            self._drop_older(self._newest)
        ring = self._maps.get(ring_id)
        if ring is None:
            try:
                fd, nbytes = self._unmapped.pop(ring_id)
            except KeyError:
                raise RuntimeError(f"procpipe worker: ring {ring_id} was never sent to this worker") from None
            try:
                ring = self._maps[ring_id] = map_fd(fd, nbytes)
            finally:
                close_fd(fd)  # (the mapping keeps the memory; mmap holds a descriptor of its own)
        return memoryview(ring)[slot * slot_bytes : (slot + 1) * slot_bytes]

    def _drop_older(self, ring_id: int) -> None:
        for old in [i for i in self._maps if i < ring_id]:
            try:
                self._maps[old].close()
            except BufferError:  # still exported: kept, and tried again on the next call
                continue
            del self._maps[old]
        for old in [i for i in self._unmapped if i < ring_id]:
            close_fd(self._unmapped.pop(old)[0])

    def mapped(self) -> list[int]:
        """The ring generations mapped here."""
        return sorted(self._maps)

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:
                pass
        self._maps.clear()
        for fd, _ in self._unmapped.values():
            close_fd(fd)
        self._unmapped.clear()


class _NoWaiter:
    """The ``wakeup`` of rings no thread sleeps on (a Ray agent's): never starved."""

    starved = False

    def wake_if_starved(self) -> None:
        """Nothing to wake."""


class RingSet:
    """The current ring (``current``, None before the first batch) and the retired ones.

    ``wakeup``: the owning thread's ``WakePipe``, woken when a slot of the current ring comes
    back while it is starved of slots (None: no thread waits for slots)."""

    def __init__(self, segments: Segments, wakeup: WakePipe | None = None) -> None:
        self.segments = segments
        self.wakeup: WakePipe | _NoWaiter = _NoWaiter() if wakeup is None else wakeup
        self.current: Ring | None = None
        self.retired: list[Ring] = []  # earlier generations some of whose slots are still in use
        self.grow_failed = False  # a larger ring did not fit (memory, shm_dir): overflows stay inline

    def make(self, slots: int, slot_bytes: int) -> Ring:
        """Create the first generation: ``slots`` slots of ``slot_bytes`` (rounded up)."""
        self.current = Ring(self.segments, 0, slots, round_slot_bytes(slot_bytes))
        return self.current

    def take(self, counters: EpochCounters) -> int | None:
        """A free slot of the current ring, or None: no ring yet, or every slot is in use.
        ``counters`` records the peak number in use."""
        ring = self.current
        if ring is None or not ring.free:
            return None
        slot = ring.free.popleft()
        in_use = ring.slots - len(ring.free)
        if in_use > counters.peak_slots_in_use:
            counters.peak_slots_in_use = in_use
        return slot

    def release(self, slot: int) -> None:
        """Return ``slot`` to its ring (any thread); a slot of the current ring wakes a
        starved coordinator."""
        ring = self.current
        if ring is None:
            return
        if not ring.owns(slot):
            old = self.ring_of(slot)
            if old is not None:
                old.free.append(slot)
            return
        ring.free.append(slot)
        if self.wakeup.starved:
            self.wakeup.wake_if_starved()

    def release_unused(self, slot: int) -> None:
        """``release`` for an attempt's slot, which is -1 when it had none."""
        if slot >= 0:
            self.release(slot)

    def ring_of(self, slot: int) -> Ring | None:
        """The generation (current or retired) slot number ``slot`` belongs to."""
        ring = self.current
        if ring is None or ring.owns(slot):
            return ring
        for old in list(self.retired):  # (a copy: the coordinator thread may remove one meanwhile)
            if old.owns(slot):
                return old
        return None

    def remove_idle(self) -> None:
        """Remove the retired generations whose slots have all come back (coordinator thread)."""
        for old in [r for r in self.retired if r.idle]:
            self.retired.remove(old)
            old.remove()

    def grow(self, nbytes: int, counters: EpochCounters | None = None, slots: int | None = None) -> str | None:
        """A batch of ``nbytes`` did not fit its slot: replace the current ring by one whose
        slots hold it with a margin of a quarter (the old one is retired), so later batches of
        that size go through the ring, not the pipes. Without a ring yet, ``slots`` (if given)
        is the first generation's count (a Ray agent's rings start so; the coordinator's first
        comes from ``make``). Returns why it could not (no memory, or no room in ``shm_dir``: such batches
        then stay inline, and no later ``grow`` tries again), else None.

        The new file is created and its pages populated here, on the owning thread:
        ``counters`` (``stats()["ring_growths"]``/``["ring_growth_s"]``) records the time."""
        old = self.current
        if self.grow_failed or (old is None and slots is None) or (old is not None and nbytes <= old.slot_bytes):
            return None
        started = time.perf_counter()
        slot_bytes = round_slot_bytes(nbytes + nbytes // 4)
        try:
            if old is None:
                ring = Ring(self.segments, 0, slots or 0, slot_bytes)
            else:
                ring = Ring(self.segments, old.ring_id + 1, old.slots, slot_bytes, old.first_slot + old.slots)
        except SharedMemoryError as exc:
            self.grow_failed = True
            return f" A larger ring did not fit: {exc}"
        finally:
            if counters is not None:
                counters.ring_growth_s += time.perf_counter() - started
        if old is not None and counters is not None:
            counters.ring_growths += 1
        self._install(ring)
        return None

    def add_slots(self, extra: int) -> str | None:
        """Replace the current ring by one with ``extra`` more slots of the same size (the old
        one is retired, and removed once its slots have come back). Returns why it could not
        (no memory, or no room in ``shm_dir``: the ring stays as it is), else None."""
        old = self.current
        if old is None or extra <= 0:
            return None
        try:
            ring = Ring(self.segments, old.ring_id + 1, old.slots + extra, old.slot_bytes, old.first_slot + old.slots)
        except SharedMemoryError as exc:
            return str(exc)
        self._install(ring)
        return None

    def _install(self, ring: Ring) -> None:
        """Make ``ring`` the current generation; the one it replaces (if any) is retired, and
        removed at once if none of its slots is out, else once they have come back."""
        old, self.current = self.current, ring
        if old is not None:
            old.retired = True
            self.retired.append(old)
            if old.idle:
                self.remove_idle()

    def close(self) -> None:
        """Unmap every generation and close its descriptor (files are removed with the others: ``Segments``)."""
        for ring in [self.current, *self.retired]:
            if ring is not None:
                ring.close()
