"""procpipe.torch.DataLoader over an IterableDataset, against torch's own DataLoader.

Every behaviour is run with both classes (``LOADER``: torch's DataLoader and the facade)
and must give the same result: the same batches in the same order (``in_order=True``:
torch's round-robin over workers), the same worker ids and seeds seen by the replicas,
the same exception types. Where procpipe differs on purpose (a worker crash), the test
asserts the documented difference. Workers start with ``fork`` for both (quick; the
default start method is covered by one facade-only test).
"""
from __future__ import annotations

import math
import os
import random
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from conftest import loader_token, mappings, warnings_as_errors

from procpipe.torch import DataLoader
from procpipe.torch.iterable import ReplicaLostError

LOADER = pytest.mark.parametrize("cls", [tud.DataLoader, DataLoader], ids=["torch", "procpipe"])


def make(cls, dataset, num_workers=2, **kwargs):
    if num_workers:
        kwargs.setdefault("multiprocessing_context", "fork")
    return cls(dataset, num_workers=num_workers, **kwargs)


def as_lists(batches):
    return [b.tolist() if isinstance(b, torch.Tensor) else [x.tolist() for x in b] for b in batches]


def worker() -> tuple[int, int]:
    info = tud.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class Strided(tud.IterableDataset):
    """Samples ``0..n-1``; worker ``w`` of ``k`` yields ``w, w+k, ...`` (user sharding), each
    with the id of the worker that yielded it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        w, k = worker()
        for i in range(w, self.n, k):
            yield torch.tensor([i, w])


class Uneven(tud.IterableDataset):
    """Worker ``w`` yields ``counts[w]`` samples ``100 * w + j``: replicas of different lengths."""

    def __init__(self, counts: tuple[int, ...]) -> None:
        self.counts = counts

    def __iter__(self):
        w, _ = worker()
        return iter([100 * w + j for j in range(self.counts[w])])


def end(it) -> None:
    """Stop torch's workers now: after an error its iterator ends them only when collected
    (the exception's traceback keeps it alive), which the leak check would wait for."""
    if isinstance(it, tud.dataloader._MultiProcessingDataLoaderIter):
        it._shutdown_workers()


def round_robin(per_worker: list[list]) -> list:
    """torch's in_order=True: one batch from each worker in turn, skipping the ended ones."""
    out, queues = [], [list(q) for q in per_worker]
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


# ---------------------------------------------------------------- sharding, order, batching
@LOADER
@pytest.mark.parametrize("num_workers", [0, 2])
def test_each_worker_iterates_its_replica_with_worker_info(cls, num_workers):
    out = as_lists(make(cls, Strided(11), num_workers, batch_size=2))
    if num_workers == 0:
        expected = [[[i, 0] for i in range(j, min(j + 2, 11))] for j in range(0, 11, 2)]
    else:
        evens, odds = list(range(0, 11, 2)), list(range(1, 11, 2))
        expected = round_robin([[[[i, 0] for i in evens[j:j + 2]] for j in range(0, len(evens), 2)],
                                [[[i, 1] for i in odds[j:j + 2]] for j in range(0, len(odds), 2)]])
    assert out == expected


@LOADER
def test_in_order_round_robin_skips_ended_workers(cls):
    counts = (5, 1, 0)
    out = [b.tolist() for b in make(cls, Uneven(counts), 3, batch_size=2)]
    assert out == round_robin([[[0, 1], [2, 3], [4]], [[100]], []])


@LOADER
def test_unordered_delivers_every_batch_each_worker_in_its_order(cls):
    out = [b.tolist() for b in make(cls, Uneven((4, 3)), 2, batch_size=1, in_order=False)]
    assert sorted(x for b in out for x in b) == [0, 1, 2, 3, 100, 101, 102]
    for w in (0, 1):
        mine = [b[0] for b in out if b[0] // 100 == w]
        assert mine == sorted(mine)


@LOADER
@pytest.mark.parametrize("num_workers", [0, 2])
def test_drop_last_drops_each_workers_short_batch(cls, num_workers):
    counts = (5, 3) if num_workers else (5,)
    out = [b.tolist() for b in make(cls, Uneven(counts), num_workers, batch_size=2, drop_last=True)]
    expected = [[0, 1], [2, 3]] if not num_workers else round_robin([[[0, 1], [2, 3]], [[100, 101]]])
    assert out == expected


@LOADER
@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_size_none_converts_each_sample(cls, num_workers):
    class Arrays(tud.IterableDataset):
        def __iter__(self):
            w, k = worker()
            for i in range(w, 5, k):
                yield {"x": np.full(2, i, np.int32), "i": i}

    out = list(make(cls, Arrays(), num_workers, batch_size=None))
    assert all(type(b["x"]) is torch.Tensor and b["x"].dtype == torch.int32 and type(b["i"]) is int for b in out)
    assert [b["i"] for b in out] == [0, 1, 2, 3, 4]  # (with 2 workers: 0, 2, 4 and 1, 3 in turn)


@LOADER
def test_custom_collate_fn_runs_in_the_worker(cls):
    def collate(samples):
        return {"sum": torch.tensor(sum(samples)), "n": len(samples), "pid": os.getpid(),
                "worker": tud.get_worker_info().id}

    loader = make(cls, Uneven((3, 2)), 2, batch_size=2, collate_fn=collate)
    out = list(loader)
    assert [(b["sum"].item(), b["n"], b["worker"]) for b in out] == [(1, 2, 0), (201, 2, 1), (2, 1, 0)]
    assert all(b["pid"] != os.getpid() for b in out)


@LOADER
def test_chain_dataset(cls):
    chain = tud.ChainDataset([Uneven((2, 1)), Uneven((1, 2))])
    out = [b.tolist() for b in make(cls, chain, 2, batch_size=2)]
    # each worker iterates the whole chain: worker 0 yields 0, 1, 0; worker 1 yields 100, 100, 101
    assert out == [[0, 1], [100, 100], [0], [101]]


# ---------------------------------------------------------------- worker set-up and seeds
class Seeds(tud.IterableDataset):
    """Yields what its worker sees: worker info, and draws from each global generator."""

    def __iter__(self):
        info = tud.get_worker_info()
        yield {"id": info.id, "num_workers": info.num_workers, "seed": info.seed, "same": info.dataset is self,
               "init": getattr(self, "init", None), "torch": torch.randint(1 << 30, (1,)).item(),
               "random": random.random(), "numpy": float(np.random.rand())}


def set_init(worker_id: int) -> None:
    tud.get_worker_info().dataset.init = worker_id * 10


@LOADER
def test_worker_info_seeds_and_worker_init_fn_as_torch(cls):
    loader = make(cls, Seeds(), 2, batch_size=None, worker_init_fn=set_init,
                  generator=torch.Generator().manual_seed(1234))
    out = list(loader)
    assert [(s["id"], s["num_workers"], s["same"], s["init"]) for s in out] == [(0, 2, True, 0), (1, 2, True, 10)]
    # torch's seeds: base_seed (drawn from the generator) + worker id; the draws follow from them
    base = torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(1234)).item()
    assert [s["seed"] for s in out] == [base, base + 1]
    torch.manual_seed(base + 1)
    random.seed(base + 1)
    assert (out[1]["torch"], out[1]["random"]) == (torch.randint(1 << 30, (1,)).item(), random.random())
    from torch.utils.data._utils.worker import _generate_state

    np.random.seed(_generate_state(base, 1))
    assert out[1]["numpy"] == float(np.random.rand())


class Epochs(tud.IterableDataset):
    """Counts, on itself, the epochs its replica has started and the worker_init_fn calls."""

    def __init__(self) -> None:
        self.epochs = 0
        self.inits = 0

    def __iter__(self):
        self.epochs += 1
        yield (worker()[0], self.epochs, self.inits)


def count_init(worker_id: int) -> None:
    tud.get_worker_info().dataset.inits += 1


@LOADER
@pytest.mark.parametrize("persistent", [False, True])
def test_persistent_workers_keep_their_replicas(cls, persistent):
    loader = make(cls, Epochs(), 2, batch_size=None, persistent_workers=persistent, worker_init_fn=count_init)
    first, second = [[tuple(x) for x in loader] for _ in range(2)]
    assert first == [(0, 1, 1), (1, 1, 1)]
    # persistent: the same replica, a new iterator (its epoch count goes on), worker_init_fn once
    assert second == ([(0, 2, 1), (1, 2, 1)] if persistent else [(0, 1, 1), (1, 1, 1)])
    if isinstance(loader, DataLoader):
        loader.close()


@LOADER
@pytest.mark.parametrize("persistent", [False, True])
def test_an_abandoned_epoch_restarts_the_replicas(cls, persistent):
    loader = make(cls, Uneven((3, 2)), 2, batch_size=1, persistent_workers=persistent)
    it = iter(loader)
    assert next(it).tolist() == [0]
    del it  # the epoch is abandoned after one batch; the next one starts every replica again
    assert [b.item() for b in loader] == [0, 100, 1, 101, 2]
    if isinstance(loader, DataLoader):
        loader.close()


@LOADER
@pytest.mark.parametrize("kwargs", [{"shuffle": True}, {"sampler": [0, 1]}, {"batch_sampler": [[0]]}])
def test_samplers_are_refused_as_torch_refuses_them(cls, kwargs):
    with pytest.raises(ValueError, match="IterableDataset"):
        cls(Uneven((1,)), **kwargs)


# ---------------------------------------------------------------- IterDataPipe
def shuffled_pipe():
    from torch.utils.data.datapipes.iter import IterableWrapper

    return IterableWrapper(list(range(20))).shuffle().sharding_filter()


@pytest.fixture
def quiet_datapipes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation warnings for DataPipes
        yield


def epochs_of(cls, num_workers, persistent=False, epochs=2):
    loader = make(cls, shuffled_pipe(), num_workers, shuffle=True, persistent_workers=persistent)
    out = []
    for _ in range(epochs):
        torch.manual_seed(123)
        out.append([int(x) for x in loader])
    if isinstance(loader, DataLoader):
        loader.close()
    return out


@LOADER
@pytest.mark.parametrize("num_workers", [0, 2])
def test_datapipe_shuffle_then_sharding_filter_as_torch(cls, num_workers, quiet_datapipes):
    """The shared seed makes every replica shuffle alike, so sharding_filter splits one order."""
    first, second = epochs_of(cls, num_workers)
    assert sorted(first) == list(range(20)) and first != list(range(20))
    assert first == second  # the same seed, the same order
    assert first == epochs_of(tud.DataLoader, 0, epochs=1)[0]  # torch's order, whatever num_workers


def test_datapipe_with_persistent_workers_stays_exact(quiet_datapipes):
    """Documented difference: a later epoch's shared seed is derived from the first one and
    the epoch (torch draws it from the generator), still the same in every replica."""
    first, second = epochs_of(DataLoader, 2, persistent=True)
    assert first == epochs_of(tud.DataLoader, 2, persistent=True, epochs=1)[0]
    assert sorted(second) == list(range(20)) and second != first
    assert [first, second] == epochs_of(DataLoader, 2, persistent=True)  # reproducible


# ---------------------------------------------------------------- len()
class Sized(tud.IterableDataset):
    def __init__(self, n: int, reported: int) -> None:
        self.n, self.reported = n, reported

    def __len__(self) -> int:
        return self.reported

    def __iter__(self):
        w, k = worker()
        return iter(range(w, self.n, k))


@LOADER
def test_len_of_an_iterable_dataset(cls):
    loader = make(cls, Sized(7, 7), 2, batch_size=2)
    assert len(loader) == math.ceil(7 / 2)
    it = iter(loader)
    with pytest.raises(TypeError):
        len(it)
    with warnings_as_errors():  # yields no more than len() said: no warning
        assert sum(len(b) for b in it) == 7
    assert len(make(cls, Sized(7, 7), 2, batch_size=2, drop_last=True)) == 3


@LOADER
@pytest.mark.parametrize("num_workers", [0, 2])
def test_warns_when_more_is_yielded_than_len_said(cls, num_workers):
    loader = make(cls, Sized(6, 3), num_workers, batch_size=1)
    it = iter(loader)
    with warnings_as_errors():  # len(loader) not asked before iter(): no warning
        assert next(it).tolist() == [0]
    len(loader)
    it = iter(loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = [b.item() for b in it]
    assert out == [0, 1, 2, 3, 4, 5]  # (with 2 workers: 0, 2, 4 and 1, 3, 5 in turn)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert [m.split("but ")[1].split(" samples")[0] for m in messages] == ["4", "5", "6"]
    assert all("Length of IterableDataset" in m for m in messages)
    assert all(("For multiprocessing data-loading" in m) == (num_workers > 0) for m in messages)


# ---------------------------------------------------------------- errors
class FailingIter(tud.IterableDataset):
    def __iter__(self):
        if worker()[0] == 0:
            raise ValueError("no iterator for you")
        return iter([1, 2])


@LOADER
@pytest.mark.parametrize("num_workers", [0, 2])
def test_error_in_iter_is_raised_with_its_type(cls, num_workers):
    loader = make(cls, FailingIter(), num_workers, batch_size=1)
    it = None
    with pytest.raises(ValueError, match="no iterator for you") as caught:
        it = iter(loader)  # (num_workers=0: __iter__ runs here, as with torch)
        list(it)
    end(it)
    if cls is DataLoader and num_workers:
        assert "__iter__ of the IterableDataset replica of worker 0, at its batch 0" in "\n".join(caught.value.__notes__)


class FailingNext(tud.IterableDataset):
    """Worker 1's generator raises at its third sample; worker 0 yields 0..3."""

    def __iter__(self):
        w, _ = worker()
        for j in range(4):
            if w == 1 and j == 2:
                raise KeyError("bad record")
            yield 100 * w + j


@LOADER
@pytest.mark.parametrize("timeout", [0, 60], ids=["direct", "timeout_thread"])
def test_error_in_next_is_raised_in_its_place_and_loading_goes_on(cls, timeout):
    it = iter(make(cls, FailingNext(), 2, batch_size=1, timeout=timeout))
    seen = []
    while True:
        try:
            seen.append(next(it).item())
        except StopIteration:
            break
        except KeyError as exc:
            seen.append("KeyError")
            if cls is DataLoader:
                assert "replica of worker 1, at its batch 2" in "\n".join(exc.__notes__)
    # worker 1's generator is over once it raised: torch's worker then ends, so does the replica
    assert seen == [0, 100, 1, 101, 2, "KeyError", 3]


def failing_init(worker_id: int) -> None:
    if worker_id == 1:
        raise OSError("cannot set up")


@LOADER
def test_error_in_worker_init_fn(cls):
    it = iter(make(cls, Uneven((2, 2)), 2, batch_size=1, worker_init_fn=failing_init))
    assert next(it).tolist() == [0]
    with pytest.raises(OSError, match="cannot set up"):
        next(it)
    end(it)


class DiesInWorker1(tud.IterableDataset):
    def __iter__(self):
        w, _ = worker()
        for j in range(6):
            if w == 1 and j == 2:
                os._exit(3)  # the process dies after worker 1 delivered 2 batches
            yield 100 * w + j


def test_worker_crash_raises_naming_the_worker():
    """Documented difference: torch reports a dead worker (a RuntimeError, "exited
    unexpectedly"; not run here: on a crash torch's own error is racy, sometimes a
    ConnectionResetError, and it can leave its other worker behind). procpipe replaces the
    worker, but the replica's iterator cannot resume, so the epoch fails with
    ReplicaLostError (a RuntimeError too) naming the worker, instead of losing or
    repeating its data."""
    loader = DataLoader(DiesInWorker1(), batch_size=1, num_workers=2, multiprocessing_context="fork",
                        max_worker_restarts=1)
    got = []
    with pytest.raises(ReplicaLostError) as caught:
        for b in loader:
            got.append(b.item())
    assert isinstance(caught.value, RuntimeError)
    assert "replica of worker 1 was lost after it had delivered 2 batch(es)" in str(caught.value)
    assert got == [0, 100, 1, 101, 2]  # everything before replica 1's lost batch, in order, once


class DiesOnceBeforeItsFirstBatch(tud.IterableDataset):
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __iter__(self):
        w, _ = worker()
        if w == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(3)  # dies before its replica delivered anything
        return iter([100 * w + j for j in range(3)])


def test_a_replica_that_delivered_nothing_starts_again_after_a_crash(tmp_path):
    """Nothing of replica 1 was delivered, so starting it again in the replacement process
    loses and repeats nothing (torch would raise here)."""
    loader = DataLoader(DiesOnceBeforeItsFirstBatch(str(tmp_path / "died")), batch_size=1, num_workers=2,
                        multiprocessing_context="fork")
    assert [b.item() for b in loader] == [0, 100, 1, 101, 2, 102]
    assert (tmp_path / "died").exists()


def test_batches_arrive_as_views_of_the_ring():
    loader = DataLoader(Strided(8), batch_size=4, num_workers=2, multiprocessing_context="fork",
                        persistent_workers=True)
    try:
        first = as_lists(loader)  # the first batches size the ring (they come inline)
        ranges, second = mappings(loader_token(loader._pp_loader)), []
        assert ranges
        for b in loader:  # persistent workers: the second epoch's batches are in ring slots
            start, end = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
            assert any(lo <= start and end <= hi for lo, hi in ranges), "a batch was copied, not a ring view"
            second.append(b.tolist())
        assert first == second == [[[0, 0], [2, 0], [4, 0], [6, 0]], [[1, 1], [3, 1], [5, 1], [7, 1]]]
    finally:
        loader.close()


def test_default_start_method_ships_the_dataset():
    out = as_lists(DataLoader(Strided(5), batch_size=2, num_workers=2))
    assert out == [[[0, 0], [2, 0]], [[1, 1], [3, 1]], [[4, 0]]]


def test_a_batch_that_cannot_travel_is_an_error_in_its_place():
    """procpipe only: torch would pickle the batch through its queue and fail there too,
    but as a crash of its pipe; here the error takes the batch's place and loading goes on."""
    def collate(samples):
        return {"x": torch.tensor(samples), "gen": (s for s in samples) if samples[0] == 100 else None}

    it = iter(DataLoader(Uneven((2, 2)), batch_size=1, num_workers=2, multiprocessing_context="fork",
                         collate_fn=collate))
    assert next(it)["x"].tolist() == [0]
    with pytest.raises(TypeError, match="generator") as caught:
        next(it)
    assert "packing the batch collate_fn returned of the IterableDataset replica of worker 1" in "\n".join(
        caught.value.__notes__)
    assert [b["x"].item() for b in it] == [1, 101]
