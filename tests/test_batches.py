"""A batch: the sample tree with stacked arrays (numpy or torch tensors), ``batch_size=None``, ``collate_fn``,
zero-copy views of a ring slot that never change, more batches than slots, a ring that grows, ``shm_dir``."""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections import namedtuple

import numpy as np
import pytest
from conftest import (
    is_ring_view,
    leaves,
    loader_token,
    mappings,
    our_shm_files,
    ring_views,
    shm_files,
    to_py,
    warnings_as_errors,
)

import procpipe
from procpipe import Loader

Point = namedtuple("Point", "x y")


@dataclasses.dataclass(frozen=True)
class Meta:
    """An arbitrary Python object inside a sample: batched as a list."""

    tag: int


def tree_sample(i):
    return {
        "image": np.full((2, 3), i, dtype=np.uint8),
        "pair": (np.float32(i / 2), i * 1.5),
        "seq": [i, bool(i % 2)],
        "point": Point(np.arange(3, dtype=np.int16) + i, np.int64(-i)),
        "name": f"s{i}",
        "raw": bytes([i, 255 - i]),
        "meta": Meta(i),
        "none": None,
    }


def assert_tree_equal(got, want):
    """Same containers (types included), same array dtypes/shapes/values, same other leaves."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_tree_equal(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_tree_equal(g, w)
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    else:
        assert got == want


# --------------------------------------------------------------------------- batch structure
@pytest.mark.parametrize("workers", [0, 2])
def test_batch_is_the_sample_tree_with_stacked_arrays(workers):
    with Loader(list(range(10)), tree_sample, batch_size=4, workers=workers) as loader:
        batches = list(loader)
    assert len(batches) == 3
    for n, batch in enumerate(batches):
        idx = list(range(n * 4, min(n * 4 + 4, 10)))
        want = {
            "image": np.stack([np.full((2, 3), i, np.uint8) for i in idx]),
            "pair": (np.array([i / 2 for i in idx], np.float32), np.array([i * 1.5 for i in idx], np.float64)),
            "seq": [np.array(idx, np.int64), np.array([bool(i % 2) for i in idx])],
            "point": Point(np.stack([np.arange(3, dtype=np.int16) + i for i in idx]), np.array([-i for i in idx])),
            "name": [f"s{i}" for i in idx],
            "raw": [bytes([i, 255 - i]) for i in idx],
            "meta": [Meta(i) for i in idx],
            "none": [None] * len(idx),
        }
        assert_tree_equal(batch, want)


@pytest.mark.parametrize("workers", [0, 2])
def test_batch_size_none_yields_single_samples(workers):
    with Loader(list(range(7)), tree_sample, batch_size=None, workers=workers) as loader:
        assert len(loader) == 7
        got = list(loader)
    assert len(got) == 7
    for i, sample in enumerate(got):
        want = tree_sample(i)
        assert_tree_equal(sample, want)
        assert type(sample["pair"][0]) is np.float32 and type(sample["pair"][1]) is float


def ragged(i):
    return np.arange(1, i % 5 + 2, dtype=np.int32) * (i + 1)


def pad_collate(samples):
    width = max(len(s) for s in samples)
    tokens = np.zeros((len(samples), width), np.int32)
    for row, s in enumerate(samples):
        tokens[row, :len(s)] = s
    return {"tokens": tokens, "lengths": np.array([len(s) for s in samples]), "note": "padded"}


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_fn_runs_instead_of_stacking(workers):
    with Loader(list(range(23)), ragged, batch_size=6, workers=workers, collate_fn=pad_collate) as loader:
        batches = list(loader)
    assert len(batches) == 4
    for n, batch in enumerate(batches):
        idx = range(n * 6, min(n * 6 + 6, 23))
        assert batch["note"] == "padded"
        assert batch["lengths"].tolist() == [len(ragged(i)) for i in idx]
        assert batch["tokens"].shape == (len(idx), max(len(ragged(i)) for i in idx))
        for row, i in enumerate(idx):
            s = ragged(i)
            assert batch["tokens"][row, :len(s)].tolist() == s.tolist()
            assert not batch["tokens"][row, len(s):].any()


# --------------------------------------------------------------------------- the ring
def record(i):
    return {"a": np.full(8, i, np.float64), "b": (np.full((2, 2), -i, np.int32), np.float32(i)), "s": str(i)}


def test_arrays_are_zero_copy_views_of_a_ring_slot():
    with Loader(list(range(64)), record, batch_size=8, workers=2, slot_bytes=1 << 16) as loader:
        prefix = loader_token(loader)
        count = 0
        for n, batch in enumerate(loader):
            maps = mappings(prefix)
            assert maps, "the ring is not mapped in the consumer"
            arrays = [a for a in leaves(batch) if isinstance(a, np.ndarray)]
            assert len(arrays) == 3
            for arr in arrays:
                assert not arr.flags.owndata
                assert is_ring_view(arr), f"batch {n}: {type(arr.base)} is not a slot lease"
                start = arr.__array_interface__["data"][0]
                assert any(lo <= start and start + arr.nbytes <= hi for lo, hi in maps), "array memory outside the ring"
            np.testing.assert_array_equal(batch["a"][:, 0], np.arange(n * 8, n * 8 + 8))
            count += 1
            del batch, arrays, arr
        assert count == 8


def noisy(i):
    rng = procpipe.sample_rng()
    return {"x": np.full(64, i, np.float64), "r": rng.random(3), "i": i}


def test_kept_batches_never_change():
    """Keep every batch of two epochs: none may be overwritten by a later batch reusing its slot."""
    with Loader(list(range(96)), noisy, batch_size=4, workers=0, shuffle=True, seed=5) as ref_loader:
        want = [to_py(b) for _ in range(2) for b in ref_loader]
    with Loader(list(range(96)), noisy, batch_size=4, workers=2, prefetch=1, shuffle=True, seed=5) as loader:
        kept, at_arrival = [], []
        for _ in range(2):
            for batch in loader:
                kept.append(batch)
                at_arrival.append(to_py(batch))
        assert len(kept) == 2 * len(loader) == 48
        assert sum(all(ring_views(b)) and ring_views(b) != [] for b in kept) >= 2, "no batch came through the ring"
        assert at_arrival == want
        assert [to_py(b) for b in kept] == want


def test_list_of_loader_with_more_batches_than_slots():
    with Loader(list(range(300)), record, batch_size=5, workers=2, prefetch=1) as loader:
        slots = 1 + 2 * 2 + 1
        assert len(loader) == 60 > 4 * slots
        batches = list(loader)
        again = list(loader)
    for run in (batches, again):
        assert len(run) == 60
        for n, b in enumerate(run):
            np.testing.assert_array_equal(b["a"][:, 3], np.arange(n * 5, n * 5 + 5))
            np.testing.assert_array_equal(b["b"][0][:, 1, 1], -np.arange(n * 5, n * 5 + 5))
            assert b["s"] == [str(i) for i in range(n * 5, n * 5 + 5)]


def big(i):
    return np.full(2048, i, np.float64)  # 16 KiB per sample


def test_batch_larger_than_its_slot_grows_the_ring():
    with warnings_as_errors():  # no overflow warning: the ring grows instead
        with Loader(list(range(40)), big, batch_size=4, workers=2, slot_bytes=4096) as loader:
            runs, overflows = [], []
            for _ in range(2):
                runs.append(list(loader))
                overflows.append(loader.stats()["overflow_batches"])
            assert loader.stats()["ring_slot_bytes"] >= 4 * 2048 * 8
    assert 1 <= overflows[0] and overflows[1] == 0  # the first epoch grew the ring; the second fits
    for run in runs:
        assert len(run) == 10
        for n, b in enumerate(run):
            assert b.shape == (4, 2048)
            np.testing.assert_array_equal(b[:, 7], np.arange(n * 4, n * 4 + 4))


def growing_collate(samples):
    """Batch k is (k + 1) times larger than batch 0: later batches outgrow a ring sized from the first."""
    width = 1000 * (max(samples) // 4 + 1)
    return np.repeat(np.array(samples, np.float64)[:, None], width, axis=1)


def test_variable_size_batches_outgrowing_the_ring_are_delivered():
    with warnings_as_errors():
        with Loader(list(range(32)), batch_size=4, workers=2, collate_fn=growing_collate) as loader:
            batches = list(loader)
    assert len(batches) == 8
    for k, b in enumerate(batches):
        assert b.shape == (4, 1000 * (k + 1))
        np.testing.assert_array_equal(b[:, -1], np.arange(k * 4, k * 4 + 4))


# --------------------------------------------------------------------------- shm_dir
def test_shm_dir_holds_the_files(shm_dir):
    before = our_shm_files()
    with Loader(list(range(20)), record, batch_size=4, workers=1, shm_dir=shm_dir) as loader:
        prefix = loader.shm_prefix
        assert prefix.startswith(os.path.join(shm_dir, "procpipe-"))
        batches = list(loader)
        files = shm_files(prefix)
        assert files and all(os.path.dirname(f) == shm_dir for f in files)
        assert our_shm_files() == before
    assert len(batches) == 5 and batches[4]["s"] == ["16", "17", "18", "19"]
    del batches
    assert shm_files(prefix) == []


def test_no_overflow_warning_when_batches_fit():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Loader(list(range(20)), record, batch_size=4, workers=2) as loader:
            assert len(list(loader)) == 5
            assert len(list(loader)) == 5
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]


# --------------------------------------------------------------------------- silent surprises
class TensorSamples:
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int):
        import torch

        return {"x": torch.full((2, 3), float(i)), "h": torch.full((2,), i, dtype=torch.bfloat16), "y": i}


@pytest.mark.parametrize("workers", [0, 2])
def test_torch_tensor_samples_are_stacked_into_tensors(workers):
    torch = pytest.importorskip("torch")
    with procpipe.Loader(TensorSamples(), batch_size=4, workers=workers) as loader:
        batches = list(loader)
    first = batches[0]
    assert isinstance(first["x"], torch.Tensor) and first["x"].shape == (4, 2, 3)
    assert first["h"].dtype == torch.bfloat16 and first["h"].shape == (4, 2)
    assert torch.equal(torch.cat([b["x"][:, 0, 0] for b in batches]), torch.arange(10, dtype=torch.float32))
    assert torch.equal(torch.cat([b["h"][:, 0] for b in batches]).float(), torch.arange(10, dtype=torch.float32))
    assert isinstance(first["y"], np.ndarray)


def test_torch_tensor_from_a_collate_fn_or_unbatched_is_a_tensor():
    torch = pytest.importorskip("torch")
    with procpipe.Loader(TensorSamples(), lambda s: s["x"], batch_size=None, workers=2) as loader:
        got = list(loader)
    assert all(isinstance(t, torch.Tensor) and t.shape == (2, 3) for t in got)
    assert [float(t[0, 0]) for t in got] == list(map(float, range(10)))
