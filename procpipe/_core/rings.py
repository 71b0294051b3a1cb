"""``RingSet``: ring generations and their slot free lists, for the coordinator and a Ray agent.

The ring (_core/shm.py) is made once the first batch tells the size of a full one. A batch
that does not fit its slot grows it: a new generation, with larger slots, replaces the
current one; the old one is *retired* and removed once all its slots have come back (the
consumer may still hold views of them). Slot numbers never repeat across generations, so
``ring_of(slot)`` finds the generation a slot belongs to.

Threads: ``take``, ``grow`` and ``remove_idle`` run on the thread (or under the lock) that
owns the rings: the coordinator's (_engine/coordinator.py), or a Ray agent's ring lock
(procpipe.ray.agent); ``release`` runs in whichever thread drops a batch's last view
(usually the consumer's), and wakes the coordinator if it said it was starved of slots.
"""

from __future__ import annotations

import time

from ..errors import SharedMemoryError
from .shm import Ring, SharedFiles, round_slot_bytes
from .stats import EpochCounters
from .wakeup import WakePipe


class _NoWaiter:
    """The ``wakeup`` of rings no thread sleeps on (a Ray agent's): never starved."""

    starved = False

    def wake_if_starved(self) -> None:
        """Nothing to wake."""


class RingSet:
    """The current ring (``current``, None before the first batch) and the retired ones.

    ``wakeup``: the owning thread's ``WakePipe``, woken when a slot of the current ring comes
    back while it is starved of slots (None: no thread waits for slots)."""

    def __init__(self, files: SharedFiles, wakeup: WakePipe | None = None) -> None:
        self.files = files
        self.wakeup: WakePipe | _NoWaiter = _NoWaiter() if wakeup is None else wakeup
        self.current: Ring | None = None
        self.retired: list[Ring] = []  # earlier generations some of whose slots are still in use
        self.grow_failed = False  # a larger ring did not fit in shm_dir: overflows stay inline

    def make(self, slots: int, slot_bytes: int) -> Ring:
        """Create the first generation: ``slots`` slots of ``slot_bytes`` (rounded up)."""
        self.current = Ring(self.files, 0, slots, round_slot_bytes(slot_bytes))
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
        comes from ``make``). Returns why it could not (``shm_dir`` has no room: such batches
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
                ring = Ring(self.files, 0, slots or 0, slot_bytes)
            else:
                ring = Ring(self.files, old.ring_id + 1, old.slots, slot_bytes, old.first_slot + old.slots)
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
        (``shm_dir`` has no room: the ring stays as it is), else None."""
        old = self.current
        if old is None or extra <= 0:
            return None
        try:
            ring = Ring(self.files, old.ring_id + 1, old.slots + extra, old.slot_bytes, old.first_slot + old.slots)
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
        """Unmap every generation (the files are removed with the others, by ``SharedFiles``)."""
        for ring in [self.current, *self.retired]:
            if ring is not None:
                ring.close()
