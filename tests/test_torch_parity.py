"""Parity harness: the DataLoader contract, run against torch's DataLoader and procpipe's.

One test per behaviour of ``torch.utils.data.DataLoader`` (map-style datasets; the
``IterableDataset`` side is tests/test_torch_iterable.py). Each test runs the same
dataset, sampler and arguments through ``torch.utils.data.DataLoader`` and
``procpipe.torch.DataLoader`` (each with its default start method unless the test is
about start methods) and asserts the same results: same batches, same types (the very
classes), same errors, same lengths. Where procpipe differs on purpose (README,
"PyTorch: procpipe.torch.DataLoader", parity table), the test asserts the documented
difference instead, and says so in its name (``..._differs_on_purpose``).

Tiny datasets and 2 workers keep it fast.
"""
from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import pickle
import random
import warnings
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from batch_compare import same

import procpipe.torch as ppt

TorchDataLoader = tud.DataLoader
ProcpipeDataLoader = ppt.DataLoader
N = 10
JOIN_S = 30


# --------------------------------------------------------------------------- helpers
def drain(loader: Any) -> list:
    """Every batch of one epoch, and the worker processes closed (procpipe's) afterwards."""
    try:
        return list(loader)
    finally:
        if isinstance(loader, ProcpipeDataLoader):
            loader.close()


def both(dataset: Any, **kwargs: Any) -> tuple[list, list]:
    """One epoch of each loader over ``dataset`` with ``kwargs``."""
    return drain(TorchDataLoader(dataset, **kwargs)), drain(ProcpipeDataLoader(dataset, **kwargs))


def outcome(loader: Any) -> list:
    """Each ``next()`` of one epoch: the batch, or ``("raised", type, message)``; until StopIteration."""
    it = iter(loader)
    out = []
    try:
        for _ in range(len(loader) + 2):
            try:
                out.append(next(it))
            except StopIteration:
                return out
            except Exception as exc:  # noqa: BLE001 - what the test compares
                out.append(("raised", type(exc), str(exc).splitlines()[0]))
        raise AssertionError(f"the iterator did not stop after {len(loader) + 2} next() calls")
    finally:
        del it
        if isinstance(loader, ProcpipeDataLoader):
            loader.close()


# --------------------------------------------------------------------------- datasets
class Squares(tud.Dataset):
    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([i, i * i]), i


class FailsAt(Squares):
    """Raises ``KeyError`` for the indices in ``bad``."""

    def __init__(self, bad: tuple[int, ...], n: int = N) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int) -> Any:
        if i in self.bad:
            raise KeyError(f"cannot load {i}")
        return super().__getitem__(i)


class WhoLoads(tud.Dataset):
    """Each sample says which worker loaded it, in which process, and what worker_init_fn saw."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        info = tud.get_worker_info()
        if info is None:
            return {"index": i, "id": -1, "workers": 0, "pid": os.getpid(), "init": -1}
        return {"index": i, "id": info.id, "workers": info.num_workers, "pid": os.getpid(),
                "init": INIT_SEEN.get(os.getpid(), -2), "has_dataset": info.dataset is not None,
                "seed": str(info.seed)}


INIT_SEEN: dict[int, int] = {}


def record_init(worker_id: int) -> None:
    INIT_SEEN[os.getpid()] = worker_id


class Holder:
    """A namedtuple and a dataclass defined inside a class (their ``__qualname__`` does not find them)."""

    Row = namedtuple("Row", ["x", "y"])

    @dataclasses.dataclass
    class Pair:
        x: torch.Tensor
        y: int


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    labels: list


class CustomBatch:
    """A user's own batch class, as torch's docs suggest for custom collate_fn + pin_memory."""

    def __init__(self, samples: list) -> None:
        self.x = torch.stack([s[0] for s in samples])
        self.y = torch.tensor([s[1] for s in samples])

    def pin_memory(self) -> CustomBatch:
        self.x, self.y = self.x.pin_memory(), self.y.pin_memory()
        return self


Point = namedtuple("Point", ["x", "y"])


class NamedSamples(tud.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        return Holder.Row(torch.tensor(float(i)), Point(i, i * 0.5))


def to_pair(samples: list) -> Holder.Pair:
    return Holder.Pair(torch.stack([s[0] for s in samples]), len(samples))


def to_batch(samples: list) -> Batch:
    return Batch(torch.stack([s[0] for s in samples]), [s[1] for s in samples])


class Counted(tud.Dataset):
    """Counts its loads in a multiprocessing Value, locks around it, and can wait on an Event."""

    def __init__(self, n: int = 8) -> None:
        self.n = n
        self.count = multiprocessing.Value("i", 0)
        self.lock = multiprocessing.Lock()
        self.sem = multiprocessing.Semaphore(2)
        self.ready = multiprocessing.Event()
        self.ready.set()
        self.seen = multiprocessing.Array("i", n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        assert self.ready.wait(JOIN_S)
        with self.sem, self.lock:
            self.count.value += 1
            self.seen[i] += 1
        return i


class BulkSampler(tud.Sampler):
    """Yields lists of indices (with ``batch_size=None`` each list goes to ``dataset[list]``)."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return -(-self.n // self.size)  # noqa: PLE0303 -- ceil(n / size), n and size >= 0

    def __iter__(self):
        order = list(range(self.n))[::-1]
        return iter([order[k:k + self.size] for k in range(0, self.n, self.size)])


class Bulk(tud.Dataset):
    """``__getitem__`` takes a list of indices and returns the whole batch (bulk loading)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, indices: list) -> Any:
        assert isinstance(indices, list), f"expected a list of indices, got {indices!r}"
        return torch.tensor(indices) * 10


class Random(tud.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return torch.randint(0, 1 << 30, (1,)).item()


def seed_worker(worker_id: int) -> None:
    torch.manual_seed(1000 + worker_id)


class Pids(tud.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return os.getpid()


# --------------------------------------------------------------------------- batching
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_len_and_drop_last(drop_last, workers):
    kwargs = dict(batch_size=3, drop_last=drop_last, num_workers=workers)
    ref, got = both(Squares(), **kwargs)
    same(ref, got)
    assert len(ref) == (3 if drop_last else 4)
    assert len(TorchDataLoader(Squares(), **kwargs)) == len(ProcpipeDataLoader(Squares(), **kwargs)) == len(ref)


def test_shuffle_follows_the_generator():
    ref = drain(TorchDataLoader(Squares(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)))
    got = drain(ProcpipeDataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2,
                                   generator=torch.Generator().manual_seed(7)))
    same(ref, got)
    assert [int(v) for b in ref for v in b[1]] != list(range(N)), "shuffled"


def test_sampler_and_batch_sampler():
    order = [9, 0, 8, 1, 7, 2]
    same(*both(Squares(), batch_size=4, sampler=order, num_workers=2))
    batches = [[3, 1], [4, 1, 5], [9]]
    same(*both(Squares(), batch_sampler=batches, num_workers=2))


def test_custom_collate_fn_result_types():
    ref, got = both(Squares(), batch_size=4, collate_fn=to_batch, num_workers=2)
    same(ref, got)
    assert all(type(b) is Batch for b in got)


@pytest.mark.parametrize("workers", [0, 2])
def test_batch_size_none_converts_each_sample(workers):
    ref, got = both(Squares(6), batch_size=None, num_workers=workers)
    same(ref, got)
    assert type(got[0][1]) is int  # default_convert leaves Python numbers alone


@pytest.mark.parametrize("workers", [0, 2])
def test_batch_size_none_with_a_sampler_of_index_lists_loads_in_bulk(workers):
    kwargs = dict(batch_size=None, sampler=BulkSampler(N, 4), num_workers=workers)
    ref, got = both(Bulk(), **kwargs)
    same(ref, got)
    assert sorted(torch.cat(got).tolist()) == [10 * i for i in range(N)]
    assert len(ProcpipeDataLoader(Bulk(), **kwargs)) == 3
    ref, got = both(Bulk(), collate_fn=lambda b: b + 1, **kwargs)  # the collate_fn sees dataset[list]
    same(ref, got)


# --------------------------------------------------------------------------- user classes
@pytest.mark.parametrize("workers", [0, 2])
def test_classes_come_back_as_the_users_own(workers):
    """namedtuples (one defined inside a class), dataclasses (one inside a class) and a batch
    class come back as instances of the very class, with default and custom collate, batched or not.

    torch's workers cannot send a class defined inside another class (pickle does not find it by
    name; torch's DataLoader then waits forever), so the reference is torch without workers."""
    for kwargs in (dict(batch_size=2), dict(batch_size=None), dict(batch_size=2, collate_fn=to_pair)):
        ref = drain(TorchDataLoader(NamedSamples(), num_workers=0, **kwargs))
        got = drain(ProcpipeDataLoader(NamedSamples(), num_workers=workers, **kwargs))
        same(ref, got)
        kind = Holder.Pair if "collate_fn" in kwargs else Holder.Row
        assert all(type(b) is kind for b in got), f"{kwargs}: {type(got[0])!r} is not {kind!r}"
        if kind is Holder.Row:
            assert all(type(b.y) is Point for b in got)
    ref, got = both(Squares(), batch_size=4, collate_fn=CustomBatch, num_workers=workers)
    assert [type(b) for b in got] == [type(b) for b in ref] == [CustomBatch] * 3
    for r, g in zip(ref, got, strict=True):
        same((r.x, r.y), (g.x, g.y))


def test_local_classes_survive_in_process():
    """A class defined in a function: with num_workers=0 both return the very object's class."""
    Local = namedtuple("Local", ["a"])

    @dataclasses.dataclass
    class LocalBatch:
        a: torch.Tensor

    for kwargs in (dict(batch_size=None, collate_fn=lambda s: Local(s[0])),
                   dict(batch_size=3, collate_fn=lambda s: LocalBatch(torch.stack([x[0] for x in s])))):
        ref, got = both(Squares(6), **kwargs)
        assert [type(b) for b in got] == [type(b) for b in ref]
        assert type(got[0]) in (Local, LocalBatch)


# --------------------------------------------------------------------------- workers
def test_worker_init_fn_and_get_worker_info():
    ref, got = both(WhoLoads(), batch_size=2, num_workers=2, worker_init_fn=record_init)
    for batches in (ref, got):
        for b in batches:
            assert b["workers"].tolist() == [2, 2]
            assert b["has_dataset"].tolist() == [True, True]
            assert b["init"].tolist() == b["id"].tolist(), "worker_init_fn got the id get_worker_info() reports"
        assert len({int(p) for b in batches for p in b["pid"]}) <= 2
        seeds = {i: int(seed) for b in batches for i, seed in zip(b["id"].tolist(), b["seed"], strict=True)}
        assert len(set(seeds.values())) == len(seeds), "each worker has its own seed"
    same([b["index"] for b in ref], [b["index"] for b in got])
    ref, got = both(WhoLoads(), batch_size=2, num_workers=0)
    same(ref, got)  # no workers: get_worker_info() is None, in this process
    assert got[0]["pid"][0] == os.getpid()


def test_which_worker_loads_which_batch_differs_on_purpose():
    """torch sends batch k to worker k % num_workers; procpipe gives each batch to the least busy
    worker (and re-runs a dead worker's batches elsewhere), so get_worker_info().id names the
    process that really loaded it: a valid id, the one its worker_init_fn received."""
    ref, got = both(WhoLoads(), batch_size=2, num_workers=2, worker_init_fn=record_init)
    assert [int(b["id"][0]) for b in ref] == [0, 1, 0, 1]  # torch: round-robin
    pid_of: dict[int, int] = {}
    for b in got:
        ids, pids = b["id"].tolist(), b["pid"].tolist()
        assert len(set(ids)) == 1 and set(ids) <= {0, 1}, "a batch is loaded by one worker"
        assert pid_of.setdefault(ids[0], pids[0]) == pids[0], "an id is one process"


def test_iterator_workers_attribute():
    """``iter(loader)._workers``: the worker processes; they exit when the iterator goes, after an
    error in a batch too."""
    for cls in (TorchDataLoader, ProcpipeDataLoader):
        loader = cls(FailsAt((2,)), batch_size=2, num_workers=2)
        it = iter(loader)
        next(it)
        with pytest.raises(KeyError):
            next(it)
        workers = it._workers
        assert len(workers) == 2 and all(w.is_alive() for w in workers), cls
        assert len({w.pid for w in workers}) == 2
        del it  # a non-persistent iterator's workers end with it
        gc.collect()  # (the raised exception's traceback and its frames form a cycle holding it)
        for w in workers:
            w.join(JOIN_S)
            assert not w.is_alive(), cls


@pytest.mark.parametrize("persistent", [False, True])
def test_persistent_workers(persistent):
    for cls in (TorchDataLoader, ProcpipeDataLoader):
        loader = cls(Pids(), batch_size=2, num_workers=2, persistent_workers=persistent)
        first = {int(p) for b in loader for p in b}
        second = {int(p) for b in loader for p in b}
        if isinstance(loader, ProcpipeDataLoader):
            loader.close()
        assert os.getpid() not in first
        assert (second <= first) if persistent else first.isdisjoint(second), (cls, first, second)


def test_dataset_synchronization_objects_with_fork():
    """mp.Value, mp.Array, Lock, Semaphore and Event in the dataset: shared by inheritance under fork."""
    for cls in (TorchDataLoader, ProcpipeDataLoader):
        ds = Counted()
        got = drain(cls(ds, batch_size=2, num_workers=2, multiprocessing_context="fork"))
        assert sorted(int(i) for b in got for i in b) == list(range(ds.n)), cls
        assert ds.count.value == ds.n and list(ds.seen) == [1] * ds.n, cls


def test_dataset_synchronization_objects_need_fork():
    """Other start methods cannot send them; torch fails in pickling, procpipe says why and what to do."""
    with pytest.raises(RuntimeError, match="SemLock|through inheritance"):
        drain(TorchDataLoader(Counted(), batch_size=2, num_workers=2, multiprocessing_context="forkserver"))
    with pytest.raises(TypeError, match=r"multiprocessing_context='forkserver'.*multiprocessing_context='fork'") as info:
        drain(ProcpipeDataLoader(Counted(), batch_size=2, num_workers=2, multiprocessing_context="forkserver"))
    assert "through inheritance" in str(info.value)


def test_auto_start_method_is_kept_for_every_epoch(monkeypatch):
    """multiprocessing_context=None: "auto" is resolved for the first epoch and kept. Once the
    training loop runs threads, later epochs' fresh workers (persistent_workers=False) still fork,
    as torch's do: a dataset holding an mp.Value keeps working."""
    import procpipe._worker.start_method as start_method

    monkeypatch.setattr(start_method, "fork_is_safe", lambda: True)  # epoch 0: no thread runs yet
    ds = Counted()
    loader = ProcpipeDataLoader(ds, batch_size=2, num_workers=2)
    try:
        first = list(loader)
        monkeypatch.setattr(start_method, "fork_is_safe", lambda: False)  # the training loop started threads
        second = list(loader)
        assert ds.count.value == 2 * ds.n
    finally:
        loader.close()
    assert sorted(int(i) for b in first + second for i in b) == sorted(2 * list(range(ds.n)))


def test_local_functions_under_forkserver_differ_on_purpose():
    """torch pickles worker_init_fn and collate_fn with pickle, which refuses a local function or a
    lambda; procpipe ships them with dill, so they work."""
    seen = []

    def init(worker_id):  # a closure: not picklable by pickle
        seen.append(worker_id)

    expected = drain(TorchDataLoader(Squares(4), batch_size=2))
    for local in (dict(worker_init_fn=init), dict(collate_fn=lambda samples: tud.default_collate(samples))):
        kwargs = dict(batch_size=2, num_workers=2, multiprocessing_context="forkserver", **local)
        with pytest.raises((AttributeError, pickle.PicklingError), match="local object|lambda"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's own hint about picklable worker arguments
            drain(TorchDataLoader(Squares(4), **kwargs))
        same(drain(ProcpipeDataLoader(Squares(4), **kwargs)), expected)


class Augmenting(tud.Dataset):
    """Draws from all three global generators, and reports who loaded the sample."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> Any:
        info = tud.get_worker_info()
        return (torch.rand(2), np.random.randint(1 << 30), random.getrandbits(30), torch.initial_seed(),
                -1 if info is None else info.id, -1 if info is None else info.seed)


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
@pytest.mark.parametrize("init", [None, seed_worker], ids=["no-init", "worker_init_fn-seeds"])
def test_random_augmentation_draws_what_torch_draws(persistent, init):
    """The schedule and the seeds are torch's (batch k to worker k % num_workers; random and
    torch seeded base_seed + id, numpy torch's derived seed, then worker_init_fn, whose seeding
    holds), so the same generator gives the very same augmented batches, epoch after epoch."""
    def epochs(cls):
        loader = cls(Augmenting(), batch_size=2, num_workers=3, shuffle=True, worker_init_fn=init,
                     persistent_workers=persistent, generator=torch.Generator().manual_seed(5))
        try:
            return [list(loader), list(loader)]
        finally:
            if isinstance(loader, ProcpipeDataLoader):
                loader.close()

    expected, got = epochs(TorchDataLoader), epochs(ProcpipeDataLoader)
    for want, have in zip(expected, got, strict=True):
        same(have, want)
    workers = [int(w) for b in got[0] for w in b[4]]
    assert workers == [k // 2 % 3 for k in range(24)], workers  # batch k on worker k % 3
    if init is None or persistent:  # (seed_worker seeds fresh workers alike every epoch, as under torch)
        assert not torch.equal(got[0][0][0], got[1][0][0]), "augmentation must change between epochs"


def test_per_batch_seeding_is_an_option_and_does_not_depend_on_num_workers():
    """procpipe's own: ``seed_globals=True`` re-seeds the global generators before every batch
    from (seed, epoch, first index), whatever worker_init_fn did, so values do not depend on
    num_workers or the schedule (torch's do)."""
    def values(cls, workers, **extra):
        return [int(v) for b in drain(cls(Random(), batch_size=2, num_workers=workers, worker_init_fn=seed_worker,
                                          generator=torch.Generator().manual_seed(3), **extra)) for v in b]

    assert values(TorchDataLoader, 1) != values(TorchDataLoader, 2)
    assert values(ProcpipeDataLoader, 1) == values(TorchDataLoader, 1)
    for mode in (True, "sample"):
        reseeded = values(ProcpipeDataLoader, 1, seed_globals=mode)
        assert reseeded == values(ProcpipeDataLoader, 2, seed_globals=mode, assign="balanced")
        assert len(set(reseeded)) == 8


def test_assign_round_robin_needs_a_fixed_worker_count():
    with pytest.raises(ValueError, match="assign must be one of"):
        ProcpipeDataLoader(Squares(4), num_workers=2, assign="fastest")


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize("workers, extra", [(0, {}), (2, {}), (2, {"timeout": 30})],
                         ids=["workers=0", "workers=2", "workers=2-timeout"])  # torch refuses timeout without workers
def test_an_error_raises_and_the_epoch_goes_on(workers, extra):
    """After a batch raises, next() goes on with the following batches; the epoch ends with its last."""
    kwargs = dict(batch_size=2, num_workers=workers, **extra)
    ref = outcome(TorchDataLoader(FailsAt((3, 8)), **kwargs))
    got = outcome(ProcpipeDataLoader(FailsAt((3, 8)), **kwargs))
    assert [x[:2] for x in got if x[0] == "raised"] == [("raised", KeyError)] * 2
    assert [x[2] for x in got if x[0] == "raised"] == ["'cannot load 3'", "'cannot load 8'"]
    same([x for x in ref if x[0] != "raised"], [x for x in got if x[0] != "raised"])
    assert [x[0] == "raised" for x in ref] == [x[0] == "raised" for x in got] == [False, True, False, False, True]


def test_every_batch_failing_raises_once_per_batch():
    for cls in (TorchDataLoader, ProcpipeDataLoader):
        got = outcome(cls(FailsAt(tuple(range(N))), batch_size=3, num_workers=2))
        assert [x[:2] for x in got] == [("raised", KeyError)] * 4, cls


def test_timeout_argument():
    same(*both(Squares(), batch_size=3, num_workers=2, timeout=30))
    for cls in (TorchDataLoader, ProcpipeDataLoader):
        with pytest.raises(ValueError, match="timeout option should be non-negative"):
            cls(Squares(), timeout=-1)


# --------------------------------------------------------------------------- the rest of the contract
def test_pin_memory_without_an_accelerator():
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: pinning really happens (covered by the GPU tests)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, got = both(Squares(), batch_size=4, num_workers=2, pin_memory=True)
    same(ref, got)
    messages = [str(w.message) for w in caught if "pin_memory" in str(w.message)]
    assert len(messages) == 2 and messages[0] == messages[1]


def test_in_order_false_yields_every_batch_once():
    ref, got = both(Squares(), batch_size=2, num_workers=2, in_order=False)
    key = lambda b: b[1].tolist()  # noqa: E731
    same(sorted(ref, key=key), sorted(got, key=key))


def test_argument_validation_is_torchs():
    for kwargs, error in ((dict(num_workers=0, prefetch_factor=2), ValueError),
                          (dict(num_workers=-1), ValueError),
                          (dict(num_workers=0, persistent_workers=True), ValueError),
                          (dict(shuffle=True, sampler=[0, 1]), ValueError),
                          (dict(batch_sampler=[[0]], batch_size=2), ValueError)):
        messages = []
        for cls in (TorchDataLoader, ProcpipeDataLoader):
            with pytest.raises(error) as info:
                cls(Squares(), **kwargs)
            messages.append(str(info.value))
        assert messages[0] == messages[1], kwargs


def test_generic_subscript():
    for cls in (TorchDataLoader, ProcpipeDataLoader):
        alias = cls[int]
        assert alias.__origin__ is cls
        loader = alias(Squares(4), batch_size=2)
        assert isinstance(loader, cls)
        same(drain(loader), drain(TorchDataLoader(Squares(4), batch_size=2)))


def test_len_of_loader_and_iterator():
    for kwargs in (dict(batch_size=3), dict(batch_size=3, drop_last=True), dict(batch_size=None),
                   dict(batch_sampler=[[0, 1], [2]])):
        lengths = []
        for cls in (TorchDataLoader, ProcpipeDataLoader):
            loader = cls(Squares(), **kwargs)
            lengths.append((len(loader), len(iter(loader))))
            if isinstance(loader, ProcpipeDataLoader):
                loader.close()
        assert lengths[0] == lengths[1], kwargs


class Mappings(tud.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return OrderedDict(b=torch.tensor(i), a=defaultdict(list, {"n": i}))


@pytest.mark.parametrize("workers", [0, 2])
def test_default_collate_keeps_mapping_classes(workers):
    ref, got = both(Mappings(), batch_size=2, num_workers=workers)
    same(ref, got)
    assert type(got[0]) is OrderedDict and type(got[0]["a"]) is defaultdict and got[0]["a"].default_factory is list
