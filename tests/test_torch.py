"""procpipe.torch: the DataLoader facade against torch's own, the device stage, sharding.

Parity tests run torch's DataLoader (in-process) and procpipe's facade (worker processes)
on the same dataset/sampler/collate and compare every batch with torch.equal (and dtype,
and container types). Zero-copy is checked by address: a tensor's data must lie inside
this process's mapping of the loader's ring file.
"""
from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import random
import sys
import threading
import warnings
from collections import OrderedDict, namedtuple

import multiprocess
import numpy as np
import pytest
import torch
import torch.utils.data as tud
from batch_compare import assert_batches_equal
from conftest import is_ring_view, loader_token, mappings, run_python, wait_until

import procpipe
import procpipe._consumer.prefetch as ppp
import procpipe.torch.cuda_transfer as ppc
from procpipe.torch import DataLoader

Point = namedtuple("Point", "x y")


class Mixed(tud.Dataset):
    """Every kind of leaf default_collate handles, nested."""

    def __init__(self, n: int = 21) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {
            "img": torch.arange(6, dtype=torch.float32).reshape(2, 3) + i,
            "label": i,
            "weight": i * 0.5,
            "flag": i % 2 == 0,
            "name": f"item{i}",
            "np": np.full(3, i, np.int16),
            "np_scalar": np.float32(i) / 2,
            "pair": (i, f"s{i}"),
            "point": Point(i, float(i)),
            "bf16": torch.full((2,), i, dtype=torch.bfloat16),
            "nested": [torch.tensor(i), {"k": i}],
        }


class Indexed(tud.Dataset):
    def __init__(self, n: int = 30) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((2,), i, dtype=torch.int64), i


def tensor_leaves(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensor_leaves(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensor_leaves(v)]
    if dataclasses.is_dataclass(x):
        return [t for f in dataclasses.fields(x) for t in tensor_leaves(getattr(x, f.name))]
    return []


def in_ring(tensor: torch.Tensor, prefix: str) -> bool:
    ranges = mappings(prefix)
    assert ranges, f"no mapping of {prefix}* in this process"
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(lo <= start and end <= hi for lo, hi in ranges)


# --------------------------------------------------------------------------- the core rule
def test_import_procpipe_does_not_import_torch_or_keras():
    code = (
        "import sys, procpipe\n"
        "assert 'torch' not in sys.modules and 'keras' not in sys.modules, 'imported by procpipe'\n"
        "with procpipe.Loader(list(range(8)), batch_size=4, workers=0, shard=(0, 2)) as l:\n"
        "    assert [b.tolist() for b in l] == [[0, 2, 4, 6]]\n"
        "assert 'torch' not in sys.modules and 'keras' not in sys.modules, 'imported by a Loader'\n"
        "print('clean')\n"
    )
    result = run_python(["-c", code], timeout=60)
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr


# --------------------------------------------------------------------------- facade parity
def test_default_collate_parity_and_zero_copy():
    expected = list(tud.DataLoader(Mixed(), batch_size=4))
    loader = DataLoader(Mixed(), batch_size=4, num_workers=2, persistent_workers=True)
    try:
        assert_batches_equal(expected, list(loader))  # the first batches of all size the ring (inline)
        pids = loader.worker_pids
        got = []
        for batch in loader:  # persistent workers: the second epoch reuses them
            for t in (batch["img"], batch["label"], batch["bf16"], batch["point"].y, batch["nested"][0]):
                assert in_ring(t, loader_token(loader._pp_loader)), "a tensor was copied, not a view of the ring"
            got.append(copy.deepcopy(batch))  # keep a copy, give the slot back
        assert_batches_equal(expected, got)
        assert loader.worker_pids == pids and len(pids) == 2
    finally:
        loader.close()


@pytest.mark.parametrize("persistent", [True, False])
def test_shuffle_order_matches_torch_across_epochs(persistent):
    # the same settings on both sides: torch draws from the generator differently with persistent workers
    torch_loader = tud.DataLoader(Indexed(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5),
                                  num_workers=1, persistent_workers=persistent)
    ours = DataLoader(Indexed(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5),
                      num_workers=1, persistent_workers=persistent)
    try:
        orders = []
        for _ in range(3):
            expected, got = list(torch_loader), list(ours)
            assert_batches_equal(expected, got)
            orders.append([int(i) for b in got for i in b[1]])
        assert orders[0] != orders[1] != orders[2], "each epoch must be a new permutation"
    finally:
        ours.close()


def test_global_rng_shuffle_matches_torch():
    torch.manual_seed(123)
    expected = [list(tud.DataLoader(Indexed(), batch_size=5, shuffle=True)) for _ in range(2)]
    torch.manual_seed(123)
    loader = DataLoader(Indexed(), batch_size=5, shuffle=True)  # num_workers=0: in-process path
    got = [list(loader) for _ in range(2)]
    for e, g in zip(expected, got, strict=True):
        assert_batches_equal(e, g)


class ReversedSampler(tud.Sampler):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(np.arange(self.n)[::-1])  # numpy integers, not int


class VariableBatches(tud.Sampler):
    sizes = [3, 1, 5, 2, 7, 4]

    def __len__(self):
        return len(self.sizes)

    def __iter__(self):
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size


def test_custom_sampler_drop_last_and_batch_sampler_parity():
    kw = dict(sampler=ReversedSampler(30), batch_size=4, drop_last=True)
    expected = list(tud.DataLoader(Indexed(), **kw))
    got = list(DataLoader(Indexed(), num_workers=2, **kw))
    assert_batches_equal(expected, got)
    assert len(got) == 7 and got[0][1].tolist() == [29, 28, 27, 26]

    expected = list(tud.DataLoader(Indexed(), batch_sampler=VariableBatches()))
    got = list(DataLoader(Indexed(), batch_sampler=VariableBatches(), num_workers=2))
    assert_batches_equal(expected, got)
    got = list(DataLoader(Indexed(), batch_sampler=VariableBatches(), num_workers=2, in_order=False))
    assert sorted(b[1].tolist() for b in got) == sorted(b[1].tolist() for b in expected)


@dataclasses.dataclass
class Batch:
    images: torch.Tensor
    labels: torch.Tensor
    extra: np.ndarray
    names: list
    meta: OrderedDict


def dataclass_collate(samples):
    return Batch(
        images=torch.stack([s["img"] for s in samples]),
        labels=torch.tensor([s["label"] for s in samples]),
        extra=np.stack([s["np"] for s in samples]),
        names=[s["name"] for s in samples],
        meta=OrderedDict(count=len(samples), bf16=torch.stack([s["bf16"] for s in samples])),
    )


def test_custom_collate_object_parity_tensors_through_the_ring():
    expected = list(tud.DataLoader(Mixed(16), batch_size=4, collate_fn=dataclass_collate))
    loader = DataLoader(Mixed(16), batch_size=4, collate_fn=dataclass_collate, num_workers=2, persistent_workers=True)
    try:
        assert_batches_equal(expected, list(loader))
        got = []
        for batch in loader:  # second epoch: the ring exists (the very first batches size it)
            assert type(batch.meta) is OrderedDict
            for t in (batch.images, batch.labels, batch.meta["bf16"]):
                assert in_ring(t, loader_token(loader._pp_loader)), "collate_fn's tensors must come through the ring"
            assert is_ring_view(batch.extra), "numpy arrays from collate_fn stay numpy, in the ring"
            got.append(copy.deepcopy(batch))
        assert_batches_equal(expected, got)
    finally:
        loader.close()


def test_unbatched_parity():
    # batch_size=None: default_convert per sample (tuples become lists, numbers stay numbers)
    expected = list(tud.DataLoader(Mixed(6), batch_size=None))
    got = list(DataLoader(Mixed(6), batch_size=None, num_workers=2))
    assert_batches_equal(expected, got)
    # ... and a custom collate_fn applied to each sample
    fn = lambda s: (s["img"] * 2, s["name"])  # noqa: E731
    expected = list(tud.DataLoader(Mixed(6), batch_size=None, collate_fn=fn))
    got = list(DataLoader(Mixed(6), batch_size=None, collate_fn=fn, num_workers=2))
    assert_batches_equal(expected, got)


def test_distributed_sampler_parity_and_cover():
    seen = []
    for rank in range(3):
        expected_sampler = tud.distributed.DistributedSampler(Indexed(31), num_replicas=3, rank=rank, seed=4)
        our_sampler = tud.distributed.DistributedSampler(Indexed(31), num_replicas=3, rank=rank, seed=4)
        torch_loader = tud.DataLoader(Indexed(31), batch_size=4, sampler=expected_sampler)
        ours = DataLoader(Indexed(31), batch_size=4, sampler=our_sampler, num_workers=1 if rank == 1 else 0,
                          persistent_workers=rank == 1)
        try:
            for epoch in range(2):
                expected_sampler.set_epoch(epoch)
                our_sampler.set_epoch(epoch)
                got = list(ours)
                assert_batches_equal(list(torch_loader), got)
                if epoch == 0:
                    seen.append([int(i) for b in got for i in b[1]])
        finally:
            ours.close()
    assert len({len(s) for s in seen}) == 1, "every rank must get the same number of samples"
    flat = [i for s in seen for i in s]
    assert set(flat) == set(range(31)) and len(flat) == 33  # 31 indices + 2 padding repeats


# --------------------------------------------------------------------------- facade semantics
class WhoAmI(tud.Dataset):
    def __init__(self, n=16):
        self.n = n
        self.offset = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import os

        info = tud.get_worker_info()
        return {
            "index": i + self.offset,
            "pid": os.getpid(),
            "worker": -1 if info is None else info.id,
            "workers": -1 if info is None else info.num_workers,
            "init": getattr(sys.modules[__name__], "_INIT_MARK", -1),
        }


def mark_worker(worker_id):
    sys.modules[__name__]._INIT_MARK = 100 + worker_id


def test_worker_init_fn_worker_info_and_persistence():
    ds = WhoAmI()
    loader = DataLoader(ds, batch_size=2, num_workers=2, worker_init_fn=mark_worker, persistent_workers=True)
    try:
        first = list(loader)
        ds.offset = 1000  # with persistent workers (as in torch) the workers keep their copy
        second = list(loader)
    finally:
        loader.close()
    rows = [(int(w), int(n), int(m)) for b in first + second for w, n, m in zip(b["worker"], b["workers"], b["init"], strict=True)]
    assert {w for w, _, _ in rows} <= {0, 1} and {n for _, n, _ in rows} == {2}
    assert all(m == 100 + w for w, _, m in rows), "worker_init_fn(worker_id) must run in each worker first"
    assert {int(p) for b in first for p in b["pid"]} == {int(p) for b in second for p in b["pid"]}
    assert [int(i) for b in second for i in b["index"]] == list(range(16))


class RenamedWhoAmI(WhoAmI):
    """Renames its worker's process as it is unpickled there (before any sample is loaded)."""

    def __setstate__(self, state):
        self.__dict__.update(state)
        multiprocess.current_process().name = "data-reader"


def test_worker_info_comes_from_procpipe_not_from_the_process_name():
    # A worker whose process was renamed (here by the dataset, as it is unpickled in a
    # forkserver-started worker) still knows its index...
    loader = DataLoader(RenamedWhoAmI(8), batch_size=2, num_workers=2, multiprocessing_context="forkserver",
                        worker_init_fn=mark_worker)
    try:
        batches = list(loader)
    finally:
        loader.close()
    rows = {(int(p), int(w), int(m)) for b in batches for p, w, m in zip(b["pid"], b["worker"], b["init"], strict=True)}
    assert {w for _, w, _ in rows} <= {0, 1} and all(m == 100 + w for _, w, m in rows)
    assert len({p for p, _, _ in rows}) == len(rows), "one worker index per process"
    # ...and a process that is no procpipe worker is none, whatever its name.
    me = multiprocess.current_process()
    name, me.name = me.name, "procpipe-worker-3"
    try:
        batch = next(iter(DataLoader(WhoAmI(4), batch_size=2, num_workers=0)))
    finally:
        me.name = name
    assert batch["worker"].tolist() == [-1, -1]  # get_worker_info() is None, as torch's without workers


def test_non_persistent_workers_restart_and_see_dataset_changes():
    ds = WhoAmI(8)
    loader = DataLoader(ds, batch_size=4, num_workers=1)
    first = list(loader)
    ds.offset = 1000  # torch re-sends the dataset to fresh workers every epoch; so do we
    second = list(loader)
    assert [int(i) for b in second for i in b["index"]] == list(range(1000, 1008))
    assert {int(p) for b in first for p in b["pid"]}.isdisjoint({int(p) for b in second for p in b["pid"]})


class Augmented(tud.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.rand(2), np.random.rand(), random.random()


def test_per_batch_seeding_makes_augmentation_independent_of_num_workers():
    """``seed_globals=True`` (procpipe's option; torch's per-worker seeds are the default)."""
    runs = {}
    for workers in (1, 2):
        loader = DataLoader(Augmented(), batch_size=3, num_workers=workers, persistent_workers=True,
                            generator=torch.Generator().manual_seed(9), seed_globals=True)
        try:
            runs[workers] = [list(loader), list(loader)]
        finally:
            loader.close()
    for a, b in zip(runs[1], runs[2], strict=True):
        assert_batches_equal(a, b)
    first, second = runs[2]
    assert not torch.equal(first[0][0], second[0][0]), "augmentation must change between epochs"
    values = torch.cat([b[0] for b in first]).flatten()
    assert len(set(values.tolist())) == len(values), "every sample must draw different numbers"

    # num_workers=0: like torch, the dataset draws from the caller's generators, untouched
    for seed_all in (torch.manual_seed, np.random.seed, random.seed):
        seed_all(1)
    expected = list(tud.DataLoader(Augmented(), batch_size=3))
    for seed_all in (torch.manual_seed, np.random.seed, random.seed):
        seed_all(1)
    assert_batches_equal(expected, list(DataLoader(Augmented(), batch_size=3)))


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks behaviour without CUDA; CUDA is present")


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks behaviour without an accelerator; one is present")
def test_pin_memory_without_accelerator_warns_like_torch_and_yields_the_same():
    assert not torch.accelerator.is_available()
    with pytest.warns(UserWarning, match="'pin_memory' argument is set as true but no accelerator") as ours:
        got = list(DataLoader(Indexed(), batch_size=8, pin_memory=True, num_workers=2))
    with warnings.catch_warnings(record=True):
        expected = list(tud.DataLoader(Indexed(), batch_size=8, pin_memory=True))
    assert_batches_equal(expected, got)
    assert len(ours) >= 1


class Blocking(tud.Dataset):
    def __init__(self, event):
        self.event = event

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 0:
            self.event.wait(60)  # stands for a hung read; released by the test
        return i


def test_timeout_raises_like_torch():
    release = multiprocess.get_context("fork").Event()
    loader = DataLoader(Blocking(release), batch_size=2, num_workers=1, timeout=0.3, multiprocessing_context="fork",
                        persistent_workers=True)
    try:
        it = iter(loader)
        with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.3 seconds"):
            next(it)
    finally:
        release.set()
        loader.close()


# --------------------------------------------------------------------------- errors
def test_unsupported_arguments_raise_clear_errors():
    class Endless(tud.Sampler):
        def __iter__(self):
            while True:
                yield 0

    with pytest.raises(TypeError, match="sampler with a length"):
        DataLoader(Indexed(), sampler=Endless())
    with pytest.raises(ValueError, match="procpipe.torch.DataLoader supports the start methods"):
        DataLoader(Indexed(), num_workers=1, multiprocessing_context=_FakeContext())
    # torch's own validation applies unchanged
    with pytest.raises(ValueError, match="mutually exclusive"):
        DataLoader(Indexed(), batch_size=4, batch_sampler=VariableBatches())
    with pytest.raises(ValueError, match="prefetch_factor"):
        DataLoader(Indexed(), prefetch_factor=2)
    with pytest.raises(ValueError, match="persistent_workers"):
        DataLoader(Indexed(), persistent_workers=True)

    class KeySampler(tud.Sampler):
        def __len__(self):
            return 2

        def __iter__(self):
            return iter(["a", "b"])

    with pytest.raises(TypeError, match="integer indices"):
        list(DataLoader(Indexed(), sampler=KeySampler(), batch_size=2))


class _FakeContext(multiprocessing.context.BaseContext):
    _name = "threads"  # a context torch accepts but procpipe has no start method for


@NO_CUDA
def test_device_cuda_without_cuda_says_so():
    with pytest.raises(RuntimeError, match=r"device='cuda' needs CUDA.*torch.cuda.is_available\(\) is False"):
        procpipe.Loader(range(8), batch_size=2, workers=2, device="cuda")
    with pytest.raises(RuntimeError, match=r"torch.cuda.is_available\(\) is False"):
        DataLoader(Indexed(), device="cuda")


def test_loader_device_errors():
    with pytest.raises(ValueError, match="supports 'cpu' and 'cuda"):
        procpipe.Loader(range(8), batch_size=2, workers=2, device="meta")
    with pytest.raises(ValueError, match="not a torch device"):
        procpipe.Loader(range(8), batch_size=2, workers=2, device="gpu please")


def test_loader_batches_hook():
    class Plan:
        def __len__(self):
            return 3

        def __call__(self, epoch):
            return [[9, 8], [epoch], [np.int64(1), torch.tensor(2), 3]]

    with procpipe.Loader(list(range(10)), batch_size=1, workers=2, batches=Plan()) as loader:
        assert len(loader) == 3
        assert [b.tolist() for b in loader] == [[9, 8], [0], [1, 2, 3]]
        assert [b.tolist() for b in loader] == [[9, 8], [1], [1, 2, 3]]
    with pytest.raises(ValueError, match="shuffle, drop_last and shard do not apply"):
        procpipe.Loader(range(10), workers=0, batches=Plan(), shuffle=True)
    with pytest.raises(IndexError, match="index 10"):
        list(procpipe.Loader(range(10), workers=0, batches=lambda e: [[10]]))
    with pytest.raises(ValueError, match="exactly one index"):
        list(procpipe.Loader(range(10), batch_size=None, workers=0, batches=lambda e: [[1, 2]]))
    with pytest.raises(TypeError, match="has no __len__|without __len__"):
        len(procpipe.Loader(range(10), workers=0, batches=lambda e: [[1]]))


# --------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("n,world", [(10, 3), (12, 4), (5, 2)])
def test_loader_shard_matches_distributed_sampler(n, world):
    for rank in range(world):
        with procpipe.Loader(range(n), batch_size=None, workers=0, shard=(rank, world)) as loader:
            got = [int(i) for i in loader]
        assert got == list(tud.distributed.DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False))


def test_loader_shard_covers_every_index_once_with_equal_lengths():
    n, world = 23, 3
    per_rank, lengths = [], set()
    for rank in range(world):
        with procpipe.Loader(range(n), batch_size=2, workers=2 if rank == 0 else 0, shuffle=True, seed=3,
                             shard=(rank, world)) as loader:
            lengths.add(len(loader))
            epochs = [[int(i) for b in loader for i in b] for _ in range(2)]
        per_rank.append(epochs)
    assert len(lengths) == 1
    for epoch in range(2):
        parts = [r[epoch] for r in per_rank]
        assert len({len(p) for p in parts}) == 1 and len(parts[0]) == 8
        flat = [i for p in parts for i in p]
        assert set(flat) == set(range(n)) and len(flat) == 24  # one index repeated as padding
    assert per_rank[0][0] != per_rank[0][1], "shuffled sharding must change every epoch"
    with pytest.raises(ValueError, match="rank, world_size"):
        procpipe.Loader(range(4), workers=0, shard=(2, 2))


# --------------------------------------------------------------------------- device stage
def sample(i):
    return {"x": np.full((4, 4), i, np.float32), "y": i, "name": f"n{i}", "pair": (np.int32(i), i * 0.5)}


def test_loader_device_cpu_yields_tensors_sharing_the_ring():
    with procpipe.Loader(range(16), sample, batch_size=4, workers=2) as plain:
        expected = [{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in b.items()} for b in plain]
    with procpipe.Loader(range(16), sample, batch_size=4, workers=2, device="cpu") as loader:
        list(loader)  # the first epoch sizes the ring
        prefix, count = loader_token(loader), 0
        for exp, batch in zip(expected, loader, strict=True):  # one batch at a time: list() would hold every slot
            count += 1
            assert isinstance(batch["x"], torch.Tensor) and isinstance(batch["pair"], tuple)
            assert batch["name"] == exp["name"]
            np.testing.assert_array_equal(batch["x"].numpy(), exp["x"])
            assert batch["y"].dtype == torch.int64 and batch["pair"][0].dtype == torch.int32
            for t in (batch["x"], batch["y"], batch["pair"][1]):
                assert in_ring(t, prefix), "device='cpu' must not copy"
        assert count == len(expected) == 4


def test_stage_thread_delivers_propagates_and_stops():
    # A CPU "transfer" exercises the thread, its queue and the slot release; copies prove the
    # ring slots go back (4 epochs through a small ring would stall otherwise).
    with procpipe.Loader(range(24), sample, batch_size=4, workers=2, prefetch=1) as loader:
        for _ in range(4):
            stage = ppp.Prefetcher(iter(loader), lambda b: ({k: (v.copy() if isinstance(v, np.ndarray) else v)
                                                         for k, v in b.items()}, None), depth=2)
            assert [int(b["y"][0]) for b in stage] == [0, 4, 8, 12, 16, 20]
        stats = loader.stats()
        assert stats["bytes_inline"] == 0 and stats["overflow_batches"] == 0, "ring slots were not released"

        def boom(batch):
            raise KeyError("transfer failed")

        with pytest.raises(KeyError, match="transfer failed"):
            next(ppp.Prefetcher(iter(loader), boom, depth=2))

        # an abandoned stage: a new epoch cancels it, its thread (blocked on a full queue) exits
        stage = ppp.Prefetcher(iter(loader), lambda b: (b, None), depth=1)
        next(stage)
        wait_until(lambda: stage._queue.full(), 10, "the stage to fill its queue")
        fresh = ppp.Prefetcher(iter(loader), lambda b: (b, None), depth=1)
        assert [int(b["y"][0]) for b in fresh] == [0, 4, 8, 12, 16, 20]
        stage._thread.join(10)
        assert not stage._thread.is_alive()
        with pytest.raises(RuntimeError, match="ended early"):
            list(stage)


def test_stage_timeout_and_on_demand_fetch():
    release = threading.Event()

    def slow():
        release.wait(30)
        yield 1

    stage = ppp.Prefetcher(slow(), lambda b: (b, None), depth=0, timeout=0.2)
    with pytest.raises(RuntimeError, match="timed out after 0.2 seconds"):
        next(stage)
    release.set()
    assert next(stage) == 1  # the pending request is answered
    with pytest.raises(StopIteration):
        next(stage)


class FakeEvent:
    def __init__(self):
        self.done = False
        self.waited = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True
        self.done = True


def test_staging_pool_reuses_a_buffer_only_after_its_copy_completed():
    pool = ppc._StagingPool(lambda n: torch.empty(n, dtype=torch.uint8), capacity=2)
    a = pool.take(100)
    ea = FakeEvent()
    pool.give(a, ea)
    b = pool.take(100)
    assert b.data_ptr() != a.data_ptr(), "a buffer whose copy is in flight must not be reused"
    eb = FakeEvent()
    pool.give(b, eb)
    c = pool.take(50)  # capacity reached: waits for the oldest copy, then reuses its buffer
    assert ea.waited and c.data_ptr() == a.data_ptr() and not eb.waited
    pool.give(c, FakeEvent())
    eb.done = True
    d = pool.take(1000)  # b finished but is too small: replaced by a bigger buffer
    assert d.numel() >= 1000 and pool.allocations == 3


def test_map_tensors_keeps_containers():
    P = namedtuple("P", "a b")
    batch = {"t": torch.ones(2), "od": OrderedDict(x=torch.zeros(1)), "p": P(torch.ones(1), "s"),
             "tup": (torch.ones(1), 3), "l": [torch.ones(1)], "np": np.ones(2), "obj": object}
    out = ppc._map_tensors(batch, lambda t: t + 1)
    assert type(out["od"]) is OrderedDict and type(out["p"]) is P and type(out["tup"]) is tuple
    assert out["t"].tolist() == [2, 2] and out["p"].a.tolist() == [2] and out["p"].b == "s"
    assert out["np"] is batch["np"] and out["obj"] is object and out["tup"][1] == 3


_PIN_MEMORY_SCRIPT = r'''
import torch
import torch.utils.data as tud
import procpipe.torch

class Indexed(tud.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return i

print("ACCELERATOR" if torch.accelerator.is_available() else "none", flush=True)
loader = procpipe.torch.DataLoader if __import__("sys").argv[1] == "procpipe" else tud.DataLoader
first = list(loader(Indexed(), batch_size=2, pin_memory=True))   # three loaders, three lines of the
second = list(loader(Indexed(), batch_size=2, pin_memory=True))  # program: torch says it once
third = list(loader(Indexed(), batch_size=2, pin_memory=True))
'''


def test_pin_memory_without_accelerator_is_said_once_per_process_as_torch_says_it(tmp_path) -> None:
    pytest.importorskip("torch")
    from conftest import run_python

    script = tmp_path / "pin.py"
    script.write_text(_PIN_MEMORY_SCRIPT)
    said = {}
    for kind in ("torch", "procpipe"):
        out = run_python(["-W", "default", str(script), kind])  # (the default filter, as a script runs)
        assert out.returncode == 0, out.stderr
        if out.stdout.startswith("ACCELERATOR"):
            pytest.skip("checks the warning without an accelerator; one is present")
        said[kind] = out.stderr.count("no accelerator is found")
    assert said == {"torch": 1, "procpipe": 1}
