"""``core.rings.RingSet``: the ring generations the coordinator and a Ray agent both keep,
without a loader around them (an agent's rings: no ring until a batch's size is known)."""
from __future__ import annotations


import pytest

from procpipe._core.rings import RingSet
from procpipe._core.shm import PAGE, Segments
from procpipe._core.stats import EpochCounters

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)


@pytest.fixture
def files():
    files = Segments()
    yield files
    files.remove_all()


def test_no_ring_until_the_first_grow_then_its_slots_are_handed_out_and_taken_back(files):
    rings, counters = RingSet(files), EpochCounters()
    assert rings.take(counters) is None and rings.current is None  # no size known yet: batches go inline
    assert rings.grow(3 * PAGE) is None and rings.current is None  # (the coordinator's: make() makes the first)
    assert rings.grow(3 * PAGE, slots=2) is None
    first = rings.current
    assert first.slots == 2 and first.slot_bytes >= 3 * PAGE + 3 * PAGE // 4  # with a quarter's margin
    taken = [rings.take(counters), rings.take(counters), rings.take(counters)]
    assert taken == [0, 1, None]  # two slots, then none free
    rings.release(1)
    rings.release_unused(-1)  # (nothing taken: nothing given back)
    assert rings.take(counters) == 1 and counters.peak_slots_in_use == 2
    rings.close()


def test_a_retired_ring_takes_its_slots_back_and_goes_once_they_are_all_back(files):
    rings, counters = RingSet(files), EpochCounters()
    rings.grow(PAGE, slots=2)
    old = rings.current
    held = rings.take(counters)
    rings.grow(8 * PAGE, counters, slots=5)  # (slots: the first generation's only; later ones keep its count)
    assert counters.ring_growths == 1
    new = rings.current
    assert (new.ring_id, new.first_slot, new.slots) == (1, 2, 2)  # slot numbers unique across generations
    assert old.retired and rings.retired == [old] and old.fd >= 0 and not old.closed
    assert rings.ring_of(held) is old and rings.ring_of(new.first_slot) is new
    assert rings.take(counters) == new.first_slot  # new slots come from the current ring only
    rings.release(held)  # back to the retired ring (any thread): its file goes once the owner removes idle ones
    rings.remove_idle()
    assert rings.retired == [] and old.closed and old.fd == -1
    rings.close()
    assert new.closed


def test_add_slots_makes_a_wider_generation_and_the_old_one_goes_once_its_slots_are_back(files):
    """``add_slots`` (a stage's spare slots, reserved once the ring exists): same slot size, more
    slots, numbers that never repeat; the old generation is removed once its slot is back."""
    rings, counters = RingSet(files), EpochCounters()
    rings.make(2, PAGE)
    old = rings.current
    held = rings.take(counters)
    assert rings.add_slots(0) is None and rings.current is old  # nothing to add
    assert rings.add_slots(3) is None
    new = rings.current
    assert new.slots == 5 and new.slot_bytes == old.slot_bytes and new.first_slot == 2
    assert old.retired and rings.retired == [old] and old.fd >= 0 and not old.closed
    assert [rings.take(counters) for _ in range(6)] == [2, 3, 4, 5, 6, None]
    rings.release(held)  # the old generation's last slot: it can go now
    rings.remove_idle()
    assert rings.retired == [] and old.closed and old.fd == -1
    rings.close()


def test_add_slots_without_a_ring_does_nothing(files):
    rings = RingSet(files)
    assert rings.add_slots(4) is None and rings.current is None
