"""A ring and the generations it replaced: where a slot number goes back, and when an old
ring's file can go.

A batch that outgrows its slot makes a larger ring (``grow``): the current ring is
*retired* (its slots are never handed out again) and removed once all of them are back
(``remove_idle``). Slot numbers are unique across generations (``Ring.first_slot``), so a
slot number alone names its ring (``ring_of``), and ``release`` needs nothing else: it is
safe to call from any thread (a batch's last view may die anywhere), while ``grow``,
``take`` and ``remove_idle`` belong to the one thread (or lock) that owns the rings.

The Ray agent's rings (procpipe.ray) are kept this way; so are, in the same shape, the
coordinator's (engine/coordinator.py).
"""

from __future__ import annotations

from .shm import Ring, SharedFiles, round_slot_bytes


class RingGenerations:
    """The current ring of ``files`` (None until the first ``grow``) and the retired ones in use."""

    def __init__(self, files: SharedFiles, slots: int) -> None:
        self.files = files
        self.slots = slots  # of the first generation; later ones keep the current one's count
        self.current: Ring | None = None
        self.retired: list[Ring] = []  # earlier generations some of whose slots are still in use

    def take(self) -> int:
        """A free slot of the current ring (removing idle retired rings first), or -1: none."""
        self.remove_idle()
        ring = self.current
        if ring is None or not ring.free:
            return -1
        return ring.free.popleft()

    def ring_of(self, slot: int) -> Ring | None:
        """The ring (current or retired) that slot number ``slot`` belongs to."""
        ring = self.current
        if ring is None or ring.owns(slot):
            return ring
        for old in list(self.retired):  # (a copy: the owning thread may remove one meanwhile)
            if old.owns(slot):
                return old
        return None

    def release(self, slot: int) -> None:
        """Give slot ``slot`` back (-1: nothing; any thread: a lease's ``on_release``)."""
        ring = self.ring_of(slot) if slot >= 0 else None
        if ring is not None:
            ring.free.append(slot)  # (a deque: append is atomic)

    def grow(self, nbytes: int, slots: int | None = None) -> Ring:
        """Make the next generation, whose slots hold ``nbytes`` with a margin of a quarter
        (``slots`` of them: the first one; later ones keep the current count); the current
        ring is retired. Raises what ``Ring`` raises (no room in the directory): nothing changes then."""
        old = self.current
        slot_bytes = round_slot_bytes(nbytes + nbytes // 4)
        if old is None:
            ring = Ring(self.files, 0, self.slots if slots is None else slots, slot_bytes)
        else:
            ring = Ring(self.files, old.ring_id + 1, old.slots, slot_bytes, old.first_slot + old.slots)
            old.retired = True
            self.retired.append(old)
        self.current = ring
        self.remove_idle()
        return ring

    def remove_idle(self) -> None:
        """Remove the retired rings whose slots have all come back (their files go now)."""
        for old in [r for r in self.retired if r.idle]:
            self.retired.remove(old)
            old.remove()

    def close(self) -> None:
        """Unmap every ring (their files are the ``SharedFiles``' to remove)."""
        for ring in [*self.retired, *([self.current] if self.current is not None else [])]:
            ring.close()
