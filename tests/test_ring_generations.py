"""``core.ring_generations.RingGenerations``: the ring generations the Ray agent keeps
(and, in the same shape, the coordinator), without a loader around them."""
from __future__ import annotations

import os

import pytest

from procpipe.core.ring_generations import RingGenerations
from procpipe.core.shm import PAGE, SharedFiles


@pytest.fixture
def files():
    files = SharedFiles("/dev/shm")
    yield files
    files.remove_all()


def test_no_ring_until_the_first_grow_then_its_slots_are_handed_out_and_taken_back(files):
    rings = RingGenerations(files, slots=2)
    assert rings.take() == -1 and rings.current is None  # no size known yet: batches go inline
    first = rings.grow(3 * PAGE)
    assert first.slots == 2 and first.slot_bytes >= 3 * PAGE + 3 * PAGE // 4  # with a quarter's margin
    taken = [rings.take(), rings.take(), rings.take()]
    assert taken == [0, 1, -1]  # two slots, then none free
    rings.release(1)
    rings.release(-1)  # (nothing taken: nothing given back)
    assert rings.take() == 1
    rings.close()


def test_a_retired_ring_takes_its_slots_back_and_goes_once_they_are_all_back(files):
    rings = RingGenerations(files, slots=2)
    old = rings.grow(PAGE)
    held = rings.take()
    new = rings.grow(8 * PAGE)
    assert (new.ring_id, new.first_slot, new.slots) == (1, 2, 2)  # slot numbers unique across generations
    assert old.retired and rings.retired == [old] and os.path.exists(old.path)
    assert rings.ring_of(held) is old and rings.ring_of(new.first_slot) is new
    assert rings.take() == new.first_slot  # new slots come from the current ring only
    rings.release(held)  # back to the retired ring (any thread): its file goes at the next take or grow
    rings.take()
    assert rings.retired == [] and not os.path.exists(old.path)
    rings.close()
    assert new.closed
