"""``core.wakeup.WakePipe``: wake() wakes a selector, drain lets the next poke wake it again."""
from __future__ import annotations

import pytest

import selectors

from procpipe._core.wakeup import WakePipe

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)


def test_a_wake_wakes_the_selector_until_drained_and_nothing_blocks_or_raises():
    pipe = WakePipe()
    selector = selectors.DefaultSelector()
    selector.register(pipe.fileno(), selectors.EVENT_READ)
    try:
        assert selector.select(0) == []
        for _ in range(100_000):  # far more than a pipe holds: a full pipe is already awake
            pipe.wake()
        assert len(selector.select(0)) == 1
        pipe.drain()
        assert selector.select(0) == []
        pipe.drain()  # (empty: nothing to read, no error)
        pipe.wake()
        assert len(selector.select(0)) == 1
    finally:
        selector.close()
        pipe.close()
    pipe.wake()  # after close: nothing happens (its descriptors may belong to other files by now)
    pipe.drain()
    pipe.close()
    assert pipe.fileno() == -1
