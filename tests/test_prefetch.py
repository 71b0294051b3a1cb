"""The generic nodes of procpipe/_consumer/prefetch.py (``Prefetcher``, ``Mapped``) over plain sources.

No torch and no Loader here: the nodes are the stdlib part of the device stage, so they are
tested over a small in-memory source node (``Numbers``) that says where it stands. The
device stage built from them (tensors, CUDA) is tested in test_device.py, test_nodes.py and
test_torch.py.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from conftest import run_python, wait_until

from procpipe._consumer.nodes import Node
from procpipe._consumer.prefetch import Mapped, Prefetcher


class Numbers(Node):
    """``0 .. n-1`` with ``get_state() == {"next": i}``; ``fail_at``: those items raise instead
    (the source then goes on with the next one, as the engine's epoch iterator does)."""

    def __init__(self, n: int, fail_at: tuple[int, ...] = ()) -> None:
        self.n = n
        self.fail_at = fail_at
        self.i = 0
        self.taken = 0  # next() calls, over every reset

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration
        i, self.i = self.i, self.i + 1
        self.taken += 1
        if i in self.fail_at:
            raise ValueError(f"item {i} failed")
        return i

    def get_state(self) -> dict[str, Any]:
        return {"next": self.i}

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        self.i = 0 if initial_state is None else initial_state["next"]


def plain(batch: Any) -> tuple[Any, None]:
    return batch, None


def no_stage_thread_left() -> bool:
    return not any(t.name == "procpipe-device-stage" for t in threading.enumerate())


@pytest.fixture
def closing() -> Any:
    """``closing(node)``: the node, closed after the test, its thread checked gone."""
    made: list[Prefetcher] = []

    def track(node: Prefetcher) -> Prefetcher:
        made.append(node)
        return node

    yield track
    for node in made:
        node.close()
    wait_until(no_stage_thread_left, 10, "the prefetch threads to stop")


def test_the_prefetcher_needs_no_torch():
    code = ("import sys\n"
            "from procpipe._consumer.prefetch import Mapped, Prefetcher\n"
            "out = list(Prefetcher(iter(range(5)), lambda b: (b * 2, None), depth=2))\n"
            "assert out == [0, 2, 4, 6, 8], out\n"
            "assert 'torch' not in sys.modules, 'procpipe._consumer.prefetch imported torch'\n"
            "print('ok')\n")
    result = run_python(["-c", code], timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("depth", [0, 3])
def test_state_is_that_of_the_batch_returned_last_not_of_those_held_ahead(closing: Callable, depth: int):
    source = Numbers(10)
    stage = closing(Prefetcher(source, plain, depth=depth))
    assert stage.get_state() == {"next": 0}
    taken = [next(stage) for _ in range(4)]
    wait_until(lambda: source.taken >= 4 + depth, 10, "the thread to run ahead")
    if depth == 0:
        assert source.taken == 4  # on demand: one batch per next(), none held ahead
    state = stage.get_state()
    assert state == {"next": 4}, "the batches the thread holds were counted as returned"
    again = Numbers(10)
    resumed = closing(Prefetcher(again, plain, depth=depth))
    resumed.reset(state)
    assert taken + list(resumed) == list(range(10))


def test_a_failed_batch_is_raised_in_the_consumer_and_the_next_one_follows(closing: Callable):
    def transfer(batch: int) -> tuple[int, None]:
        if batch == 4:
            raise KeyError("transfer of 4 failed")
        return batch * 10, None

    stage = closing(Prefetcher(Numbers(6, fail_at=(2,)), transfer, depth=2))
    assert [next(stage), next(stage)] == [0, 10]
    with pytest.raises(ValueError, match="item 2 failed"):  # the source's error
        next(stage)
    assert stage.get_state() == {"next": 3}  # the failed batch counts as had: a resume does not retry it
    assert next(stage) == 30
    with pytest.raises(KeyError, match="transfer of 4 failed"):  # the function's error
        next(stage)
    assert stage.get_state() == {"next": 5}
    assert list(stage) == [50]
    with pytest.raises(StopIteration):
        next(stage)


def test_ready_runs_in_the_consumers_thread_before_its_batch_is_returned(closing: Callable):
    calls: list[tuple[int, int]] = []

    def transfer(batch: int) -> tuple[int, Callable[[], None]]:
        return batch, lambda: calls.append((batch, threading.get_ident()))

    stage = closing(Prefetcher(Numbers(3), transfer, depth=2))
    for expected in range(3):
        assert next(stage) == expected
        assert calls[-1] == (expected, threading.get_ident())


def test_reset_of_a_prefetcher_over_a_plain_iterator_names_the_cause(closing: Callable):
    stage = closing(Prefetcher(iter([1, 2, 3]), plain, depth=1))
    assert next(stage) == 1
    with pytest.raises(TypeError, match="list_iterator, has no reset"):
        stage.reset()
    with pytest.raises(TypeError, match="has no get_state"):
        stage.get_state()


def test_mapped_runs_inline_and_passes_its_sources_state_through():
    source = Numbers(5)
    node = Mapped(source, lambda b: -b)
    assert [next(node), next(node)] == [0, -1]
    assert source.taken == 2 and node.get_state() == {"next": 2}
    node.reset({"next": 4})
    assert list(node) == [-4]


def test_close_passes_through_mapped_and_stops_a_prefetchers_thread():
    """``close()`` (what ``Loader.close()`` and the next ``iter()`` call on the root node): a
    ``Mapped`` passes it to its source (a plain iterator under it has none: nothing to do), and a
    ``Prefetcher`` returns only once its thread has stopped."""
    before = set(threading.enumerate())
    inner = Prefetcher(Numbers(1000), lambda b: (b, None), depth=2)
    started = [t for t in threading.enumerate() if t not in before]
    outer = Mapped(inner, lambda b: -b)
    assert next(outer) == 0
    assert len(started) == 1 and started[0].is_alive()
    outer.close()
    assert not started[0].is_alive()
    Mapped(iter([1, 2]), lambda b: b).close()  # no close() below it: nothing to do
