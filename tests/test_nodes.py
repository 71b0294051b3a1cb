"""The consumer side as nodes (procpipe/_consumer/nodes.py): one save/load test over every node kind.

torchdata's ``run_test_save_load_state`` idea: ``check_save_load`` iterates ``k`` items of a
node, takes ``get_state()`` (through JSON), resets a FRESH node of the same kind with it and
finishes; every item of every epoch comes exactly once and, ordered, in the order of an
uninterrupted run. ``k = 0`` resumes from the start, ``k = all`` from the end: the fresh
node then gives the next iteration (the epochs after ``until``), as the Loader does.

Kinds: the engine's source (workers) x {indexed, Shards} x {ordered, sloppy}; the inline
sources (``workers=0``) for both; the device stage's ``Prefetcher`` (a prefetching thread) over
a source; ``Mapped`` over a source; and the Loader's root (``state_dict`` /
``load_state_dict``) with ``device="cpu"`` and a ``device_fn``.

Also the defect the ``Prefetcher`` fixes: its thread runs ahead of the consumer, and a state
taken then used to count the prefetched batches as returned, so a resumed epoch ended
short, silently.
"""
from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from conftest import wait_until
from procpipe import Loader, Shards
from shardkit import SHARDS, open_shard  # the workers import it: a module without torch (its docstring)

torch = pytest.importorskip("torch")
from procpipe.torch import device as torch_device  # noqa: E402  (needs torch)
from procpipe._consumer.prefetch import Mapped, Prefetcher  # noqa: E402

EPOCHS = 2
INDEXED = list(range(30))  # 8 batches of 4 per epoch (the last one short)
BATCHES = 2 * 8  # batches of one iteration (both sources: 30 records in batches of 4)


def items_of_epoch(kind: str) -> list[int]:
    return sorted(INDEXED) if kind == "indexed" else sorted(s * 100 + i for s, n in SHARDS for i in range(n))


def tagged(pair: Any) -> tuple[int, list[int]]:
    epoch, batch = pair
    return int(epoch), [int(x) for x in np.asarray(batch).reshape(-1)]


def identity_transfer(batch: Any) -> tuple[Any, None]:
    return batch, None


def scale(batch: Any) -> Any:  # a device_fn (runs in the consumer's thread with device="cpu")
    return batch * 1


class LoaderRoot:
    """The Loader's root as a node: ``get_state`` is ``state_dict``, ``reset`` is
    ``load_state_dict`` then ``iter`` (the public API the other nodes stand behind)."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self.it = iter(loader)

    def __iter__(self) -> LoaderRoot:
        return self

    def __next__(self) -> Any:
        return next(self.it)

    def get_state(self) -> dict:
        return self.loader.state_dict()

    def reset(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self.it = iter(self.loader)


def loader_for(stack: contextlib.ExitStack, kind: str, workers: int, ordered: bool, start: int, **extra) -> Loader:
    source = INDEXED if kind == "indexed" else Shards(SHARDS, open_shard, cycle_length=2, block_length=3)
    loader = stack.enter_context(Loader(source, batch_size=4, workers=workers, ordered=ordered, epochs=EPOCHS,
                                        shuffle=True, seed=11, with_epoch=True, **extra))
    loader.set_epoch(start)
    return loader


def stage_over(stack: contextlib.ExitStack, source: Iterator) -> Prefetcher:
    stage = Prefetcher(source, identity_transfer, depth=3)
    stack.callback(stage.close)
    return stage


# name -> (make(stack, start_epoch) -> node, ordered, kind)
NODES: dict[str, tuple[Callable[[contextlib.ExitStack, int], Any], bool, str]] = {}
for _kind in ("indexed", "shards"):
    for _ordered in (True, False):
        NODES[f"engine-{_kind}-{'ordered' if _ordered else 'sloppy'}"] = (
            lambda s, e, k=_kind, o=_ordered: iter(loader_for(s, k, 2, o, e)), _ordered, _kind)
    NODES[f"inline-{_kind}"] = (lambda s, e, k=_kind: iter(loader_for(s, k, 0, True, e)), True, _kind)
NODES["stage-over-engine-indexed"] = (
    lambda s, e: stage_over(s, iter(loader_for(s, "indexed", 2, True, e))), True, "indexed")
NODES["stage-over-engine-shards-sloppy"] = (
    lambda s, e: stage_over(s, iter(loader_for(s, "shards", 2, False, e))), False, "shards")
NODES["stage-over-inline-shards"] = (
    lambda s, e: stage_over(s, iter(loader_for(s, "shards", 0, True, e))), True, "shards")
NODES["mapped-over-inline-indexed"] = (
    lambda s, e: Mapped(iter(loader_for(s, "indexed", 0, True, e)), lambda pair: pair), True, "indexed")
NODES["loader-root-device-cpu-shards"] = (
    lambda s, e: LoaderRoot(loader_for(s, "shards", 2, True, e, device="cpu", device_fn=scale)), True, "shards")


def items(batches: list[tuple[int, list[int]]]) -> Counter:
    """How many times each (epoch, item) came."""
    return Counter((e, x) for e, batch in batches for x in batch)


def check_save_load(make: Callable[[contextlib.ExitStack, int], Any], ordered: bool, kind: str, k: int) -> None:
    """Take ``k`` items of a node, save, reset a fresh node with the state, finish; compare."""
    with contextlib.ExitStack() as stack:
        full = [tagged(p) for p in make(stack, 0)]
    assert len(full) == BATCHES
    with contextlib.ExitStack() as stack:
        first = make(stack, 0)
        taken = [tagged(next(first)) for _ in range(k)]
        state = json.loads(json.dumps(first.get_state()))
    with contextlib.ExitStack() as stack:
        fresh = make(stack, 0)
        fresh.reset(state)
        rest = [tagged(p) for p in fresh]
    if k == len(full):  # nothing left: the state is the start of the next iteration
        with contextlib.ExitStack() as stack:
            following = [tagged(p) for p in make(stack, EPOCHS)]
        assert {e for e, _ in following} == {EPOCHS, EPOCHS + 1}
        if ordered:
            assert rest == following, state
        else:  # sloppy: the same records per epoch (a Shards source may cut its batches differently)
            assert items(rest) == items(following), state
        return
    got = taken + rest
    expected = Counter((e, x) for e in range(EPOCHS) for x in items_of_epoch(kind))
    assert items(got) == expected, (k, state)
    if ordered:
        assert got == full, (k, state)


@pytest.mark.parametrize("k", [0, 3, 10, BATCHES], ids=["k0", "k3", "k10-second-epoch", "k-all"])
@pytest.mark.parametrize("name", list(NODES))
def test_save_load_state_of_every_node(name, k):
    make, ordered, kind = NODES[name]
    check_save_load(make, ordered, kind, k)


# --------------------------------------------------------------------------- the stage's prefetch
class _CountingTransfer:
    """An identity transfer that counts the batches the stage's thread took from its source."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, batch: Any, *args: Any, **kwargs: Any) -> tuple[Any, None]:
        self.count += 1
        return batch, None


@pytest.mark.parametrize("workers", [0, 2])
def test_state_of_a_prefetching_device_stage_does_not_count_batches_it_holds(monkeypatch, workers):
    """``Loader(device="cuda")``'s stage thread pulls batches ahead of the consumer. Here the CPU
    device stage is made that same thread (identity transfer) so the Loader's own ``state_dict``
    goes through it: taken while the thread holds batches, it must not count them as returned."""
    transfers: list[_CountingTransfer] = []

    def threaded(self, it):  # TorchDeviceStage.__call__ as on CUDA: a Prefetcher thread over the source
        transfer = _CountingTransfer()
        transfers.append(transfer)
        return Prefetcher(it, transfer, depth=self.prefetch)

    monkeypatch.setattr(torch_device.TorchDeviceStage, "__call__", threaded)
    k, prefetch = 3, 3
    with contextlib.ExitStack() as stack:
        first = loader_for(stack, "indexed", workers, True, 0, device="cpu", prefetch=prefetch)
        it = iter(first)
        taken = [tagged(next(it)) for _ in range(k)]
        wait_until(lambda: transfers[0].count >= k + prefetch, 60, "the stage thread to prefetch")
        state = json.loads(json.dumps(first.state_dict()))
    with contextlib.ExitStack() as stack:
        second = loader_for(stack, "indexed", workers, True, 0, device="cpu", prefetch=prefetch)
        second.load_state_dict(state)
        rest = [tagged(p) for p in second]
    with contextlib.ExitStack() as stack:
        full = [tagged(p) for p in loader_for(stack, "indexed", workers, True, 0)]
    assert taken + rest == full, state


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["indexed", "shards"])
def test_iterate_puts_the_callers_stage_at_the_root(kind, workers):
    """``Loader.iterate(stage)`` (procpipe.jax's way in): the caller's stage over the iteration's
    nodes is the node ``state_dict`` asks, so a prefetching thread's batches are not counted."""
    transfer = _CountingTransfer()
    k, depth = 3, 3
    with contextlib.ExitStack() as stack:
        first = loader_for(stack, kind, workers, True, 0)
        it = first.iterate(lambda node: Prefetcher(node, transfer, depth=depth))
        assert isinstance(it, Prefetcher)
        taken = [tagged(next(it)) for _ in range(k)]
        wait_until(lambda: transfer.count >= k + depth, 60, "the stage thread to prefetch")
        state = json.loads(json.dumps(first.state_dict()))
    with contextlib.ExitStack() as stack:
        second = loader_for(stack, kind, workers, True, 0)
        second.load_state_dict(state)
        rest = [tagged(p) for p in second]
    with contextlib.ExitStack() as stack:
        full = [tagged(p) for p in loader_for(stack, kind, workers, True, 0)]
    assert taken + rest == full, state


def _stage_threads_started_by(action: Callable[[], Any]) -> tuple[Any, list[threading.Thread]]:
    before = set(threading.enumerate())
    out = action()
    return out, [t for t in threading.enumerate() if t not in before and t.name == "procpipe-device-stage"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("end", ["close", "new_iteration", "load_state_dict"])
def test_ending_an_iteration_stops_the_callers_stage_thread(workers, end):
    """Once the loader closes, starts another iteration or loads a state, the prefetching thread
    of the abandoned one has stopped (joined), not merely been told to: a thread left inside a
    library's transfer (JAX's) when the interpreter exits aborts the process."""
    transfer = _CountingTransfer()
    with contextlib.ExitStack() as stack:
        loader = loader_for(stack, "indexed", workers, True, 0)
        it, threads = _stage_threads_started_by(lambda: loader.iterate(lambda n: Prefetcher(n, transfer, depth=3)))
        assert len(threads) == 1
        next(it)
        state = loader.state_dict()
        if end == "close":
            loader.close()
        elif end == "new_iteration":
            _, more = _stage_threads_started_by(lambda: loader.iterate(lambda n: Prefetcher(n, transfer, depth=3)))
            threads += more
            assert len(more) == 1 and more[0].is_alive()
        else:
            loader.load_state_dict(state)
        assert not threads[0].is_alive(), f"the stage thread still runs after {end}"
        loader.close()
        assert not any(t.is_alive() for t in threads)


def test_stage_state_before_any_batch_is_its_sources_start():
    with contextlib.ExitStack() as stack:
        source = iter(loader_for(stack, "indexed", 0, True, 0))
        start = source.get_state()
        transfer = _CountingTransfer()
        stage = Prefetcher(source, transfer, depth=2)
        stack.callback(stage.close)
        wait_until(lambda: transfer.count >= 2, 30, "the stage thread to run ahead")
        assert stage.get_state() == start  # the source ran ahead; the consumer has had nothing
        assert start["done_below"] == 0
        next(stage)
        assert stage.get_state()["done_below"] == 1


def test_state_saved_with_a_device_stage_loads_without_one_and_back():
    """A stage passes its source's state through: the position does not depend on ``device=``."""
    with contextlib.ExitStack() as stack:
        full = [tagged(p) for p in loader_for(stack, "shards", 0, True, 0)]
    with contextlib.ExitStack() as stack:
        with_device = loader_for(stack, "shards", 0, True, 0, device="cpu", device_fn=scale)
        it = iter(with_device)
        taken = [tagged(next(it)) for _ in range(5)]
        state = json.loads(json.dumps(with_device.state_dict()))
        plain = loader_for(stack, "shards", 0, True, 0)
        plain.load_state_dict(state)
        it = iter(plain)
        taken += [tagged(next(it)) for _ in range(5)]
        back = loader_for(stack, "shards", 0, True, 0, device="cpu", device_fn=scale)
        back.load_state_dict(json.loads(json.dumps(plain.state_dict())))
        rest = [tagged(p) for p in back]
    assert taken + rest == full


def test_reset_refuses_a_corrupt_position_and_keeps_going():
    with contextlib.ExitStack() as stack:
        node = iter(loader_for(stack, "indexed", 0, True, 0))
        first = tagged(next(node))
        with pytest.raises(ValueError, match="corrupt procpipe Loader state"):
            node.reset({"epoch": 0, "done_below": -1, "done": []})
        assert tagged(next(node)) != first  # the iteration it had goes on
        node.reset(None)  # None: from the start of loader.epoch, as a new iter() would
        assert tagged(next(node))[0] == 1  # the loader stood at epoch 1 (after epoch 0's first batch)


def test_cuda_state_dict_does_not_count_prefetched_batches():
    """The same as the threaded-stage test above, with the real CUDA stage (on a CUDA machine)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    k, prefetch = 3, 3

    def moved(loader):
        info = loader.stats()["device"]
        return info["direct_batches"] + info["staged_batches"]

    def host(pair):
        epoch, batch = pair
        return int(epoch), [int(x) for x in batch.cpu().reshape(-1)]

    with contextlib.ExitStack() as stack:
        full = [tagged(p) for p in loader_for(stack, "indexed", 2, True, 0)]
    with contextlib.ExitStack() as stack:
        first = loader_for(stack, "indexed", 2, True, 0, device="cuda", prefetch=prefetch)
        it = iter(first)
        taken = [host(next(it)) for _ in range(k)]
        wait_until(lambda: moved(first) >= k + prefetch, 60, "the stage thread to prefetch")
        state = json.loads(json.dumps(first.state_dict()))
        second = loader_for(stack, "indexed", 2, True, 0, device="cuda", prefetch=prefetch)
        second.load_state_dict(state)
        rest = [host(p) for p in second]
    assert taken + rest == full, state
