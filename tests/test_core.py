"""Core behaviour of procpipe.Loader: batch structure, zero-copy ring, order, determinism, start methods."""
from __future__ import annotations

import dataclasses
import json
import os
import textwrap
import threading
import time
import warnings
from collections import namedtuple

import numpy as np
import pytest
from conftest import is_ring_view, leaves, loader_token, mappings, our_shm_files, ring_views, run_python, shm_files

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


def to_py(tree):
    """A batch as plain Python (arrays become (dtype, nested lists)) for whole-structure comparisons."""
    if isinstance(tree, dict):
        return {k: to_py(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree).__name__, [to_py(v) for v in tree]
    if isinstance(tree, np.ndarray):
        return str(tree.dtype), tree.tolist()
    return tree


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
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning: the ring grows instead
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
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Loader(list(range(32)), batch_size=4, workers=2, collate_fn=growing_collate) as loader:
            batches = list(loader)
    assert len(batches) == 8
    for k, b in enumerate(batches):
        assert b.shape == (4, 1000 * (k + 1))
        np.testing.assert_array_equal(b[:, -1], np.arange(k * 4, k * 4 + 4))


# --------------------------------------------------------------------------- order and length
def straggler(i):
    if i % 9 == 0:
        time.sleep(0.01)  # workload, not synchronization: makes batches finish out of order
    return i


@pytest.mark.parametrize("shuffle", [False, True])
def test_ordered_yields_sampler_order(shuffle):
    with Loader(list(range(70)), straggler, batch_size=4, workers=0, shuffle=shuffle, seed=11) as ref:
        want = [b.tolist() for b in ref]
    with Loader(list(range(70)), straggler, batch_size=4, workers=2, shuffle=shuffle, seed=11, ordered=True) as loader:
        got = [b.tolist() for b in loader]
    assert got == want
    flat = [i for b in got for i in b]
    assert sorted(flat) == list(range(70))
    if not shuffle:
        assert flat == list(range(70))
    else:
        assert flat != list(range(70))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_unordered_delivers_every_index_exactly_once(shuffle, drop_last):
    n, bs = 103, 10
    with Loader(list(range(n)), straggler, batch_size=bs, workers=0, shuffle=shuffle, drop_last=drop_last) as ref:
        want_batches = sorted(tuple(b.tolist()) for b in ref)
    with Loader(list(range(n)), straggler, batch_size=bs, workers=2, shuffle=shuffle, drop_last=drop_last,
                ordered=False) as loader:
        assert len(loader) == (10 if drop_last else 11)
        for _ in range(2):
            got = [b.tolist() for b in loader]
            assert len(got) == len(loader)
            flat = [i for b in got for i in b]
            assert len(flat) == len(set(flat)) == (100 if drop_last else 103)
            if not drop_last:
                assert sorted(flat) == list(range(n))
            if not shuffle:  # same epoch, same batches
                assert sorted(tuple(b) for b in got) == want_batches
            assert sorted(len(b) for b in got) == sorted([bs] * 10 + ([] if drop_last else [n % bs]))


@pytest.mark.parametrize(("n", "batch_size", "drop_last", "expected"), [
    (10, 3, False, 4), (10, 3, True, 3), (9, 3, True, 3), (10, None, False, 10), (10, 10, False, 1),
    (2, 4, True, 0), (0, 4, False, 0),
])
@pytest.mark.parametrize("workers", [0, 1])
def test_len_matches_what_is_yielded(n, batch_size, drop_last, expected, workers):
    with Loader(list(range(n)), batch_size=batch_size, drop_last=drop_last, workers=workers) as loader:
        assert len(loader) == expected
        got = list_within(loader, 30)
        assert len(got) == expected
        sizes = [1 if batch_size is None else len(b) for b in got]
        assert sum(sizes) == (n // (batch_size or 1) * (batch_size or 1) if drop_last else n)


def list_within(loader, timeout):
    """list(loader) in a thread: an epoch that never ends fails the test instead of hanging it."""
    result = []
    thread = threading.Thread(target=lambda: result.append(list(loader)), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the epoch did not end within {timeout} s"
    return result[0]


# --------------------------------------------------------------------------- determinism
def augment(i):
    rng = procpipe.sample_rng()
    x = np.full(4, float(i)) + rng.normal(size=4)
    if rng.random() < 0.5:
        x = x[::-1].copy()
    return {"i": i, "x": x, "k": int(rng.integers(1 << 30))}


def per_sample(batches):
    """{index: (x, k)} from a list of batches."""
    out = {}
    for b in batches:
        for row, i in enumerate(b["i"].tolist()):
            assert i not in out
            out[i] = (tuple(b["x"][row].tolist()), int(b["k"][row]))
    return out


def _epochs(workers, ordered, seed=3, epochs=2, first_epoch=None):
    with Loader(list(range(37)), augment, batch_size=5, workers=workers, ordered=ordered, shuffle=True,
                seed=seed) as loader:
        if first_epoch is not None:
            loader.set_epoch(first_epoch)
        return [[to_py(b) for b in loader] for _ in range(epochs)]


def test_output_is_identical_for_any_worker_count_and_order():
    reference = _epochs(0, True)
    ref_samples = [per_sample(_as_batches(e)) for e in reference]
    for workers in (1, 2, 4):
        assert _epochs(workers, True) == reference, f"workers={workers}, ordered"
        unordered = _epochs(workers, False)
        for e in range(2):
            assert per_sample(_as_batches(unordered[e])) == ref_samples[e], f"workers={workers}, sloppy"


def _as_batches(epoch):
    """Turn to_py() batches back into the dicts per_sample() reads."""
    return [{"i": np.array(b["i"][1]), "x": np.array(b["x"][1]), "k": np.array(b["k"][1])} for b in epoch]


def test_shuffle_differs_between_epochs_and_is_reproduced_by_the_seed():
    first = _epochs(2, True, seed=3, epochs=3)
    orders = [[i for b in e for i in b["i"][1]] for e in first]
    assert all(sorted(o) == list(range(37)) for o in orders)
    assert orders[0] != orders[1] != orders[2] != orders[0]
    assert _epochs(2, True, seed=3, epochs=3) == first
    other_seed = [[i for b in e for i in b["i"][1]] for e in _epochs(0, True, seed=4, epochs=1)]
    assert other_seed[0] != orders[0]
    # the per-sample random stream depends on the epoch too
    s0, s1 = (per_sample(_as_batches(e)) for e in first[:2])
    assert sum(s0[i][1] != s1[i][1] for i in range(37)) > 30


def test_set_epoch_reproduces_a_given_epoch():
    with Loader(list(range(37)), augment, batch_size=5, workers=2, shuffle=True, seed=3) as loader:
        assert loader.epoch == 0
        epochs = [[to_py(b) for b in loader] for _ in range(3)]
        assert loader.epoch == 3
        loader.set_epoch(1)
        assert loader.epoch == 1
        assert [to_py(b) for b in loader] == epochs[1]
        assert loader.epoch == 2
        with pytest.raises(ValueError, match="epoch"):
            loader.set_epoch(-1)
    assert _epochs(1, True, first_epoch=2, epochs=1)[0] == epochs[2]


def test_sample_rng_outside_a_loader_raises():
    with pytest.raises(RuntimeError, match="outside a procpipe.Loader"):
        procpipe.sample_rng()


# --------------------------------------------------------------------------- user code, start methods
SCALE = 3


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_lambdas_closures_and_local_classes_with_each_start_method(start_method):
    offset = 100

    class Local:  # defined in a function: cannot be pickled by reference
        def __len__(self):
            return 11

        def __getitem__(self, i):
            return i + offset

    def closure(v):
        return {"v": np.int64(v * SCALE), "r": procpipe.sample_rng().random()}

    kwargs = dict(batch_size=3, collate_fn=lambda s: {"v": np.array([x["v"] for x in s]), "r": [x["r"] for x in s]})
    with Loader(Local(), closure, workers=0, **kwargs) as ref:
        want = [to_py(b) for b in ref]
    with Loader(Local(), closure, workers=2, start_method=start_method, **kwargs) as loader:
        got = [to_py(b) for b in loader]
        got_again = [to_py(b) for b in loader]
        pids = loader.worker_pids
    assert got == want and got_again[0]["v"] == want[0]["v"]
    assert [v for b in got for v in b["v"][1]] == [(i + offset) * SCALE for i in range(11)]
    assert len(set(pids)) == 2 and os.getpid() not in pids


MAIN_SCRIPT = textwrap.dedent('''
    import json
    import sys

    import numpy as np
    import procpipe

    SCALE = 3


    class Squares:
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return i * i


    class AddNoise:
        def __init__(self, k):
            self.k = k

        def __call__(self, v):
            return {"v": v * SCALE + self.k, "r": float(procpipe.sample_rng().random())}


    def make_collate(tag):
        def collate(samples):
            return {"v": np.array([s["v"] for s in samples]), "r": np.array([s["r"] for s in samples]), "tag": tag}
        return collate


    def run(method, workers):
        noise = AddNoise(1)
        out = []
        with procpipe.Loader(Squares(), lambda v: noise(v), batch_size=5, workers=workers,
                             collate_fn=make_collate("t"), start_method=method, shuffle=True, seed=7) as loader:
            for _ in range(2):
                for b in loader:
                    out.append([b["v"].tolist(), b["r"].tolist(), b["tag"]])
            pids = loader.worker_pids
        return out, pids


    if __name__ == "__main__":
        method = sys.argv[1]
        got, pids = run(method, 2)
        want, _ = run(method, 0)
        print(json.dumps({"got": got, "want": want, "pids": pids}))
''')


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_code_defined_in_main_script(tmp_path, start_method):
    script = tmp_path / "train.py"
    script.write_text(MAIN_SCRIPT)
    proc = run_python([str(script), start_method], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["got"] == out["want"]
    assert len(out["got"]) == 10
    first_epoch = sorted(v for b in out["got"][:5] for v in b[0])
    assert first_epoch == sorted(i * i * 3 + 1 for i in range(24))
    assert all(b[2] == "t" for b in out["got"])
    assert len(set(out["pids"])) == 2


def test_lambda_referencing_a_global_in_python_c():
    code = textwrap.dedent('''
        import numpy as np, procpipe
        OFFSET = 1000
        with procpipe.Loader(list(range(10)), lambda i: np.int64(i + OFFSET), batch_size=4, workers=2) as L:
            print(sum(int(b.sum()) for b in L), len(L.worker_pids))
    ''')
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(sum(range(10)) + 10 * 1000), "2"]


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


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterator_superseded_by_a_new_epoch_says_so(workers):
    with Loader(list(range(40)), batch_size=4, workers=workers) as loader:
        old = iter(loader)
        next(old)
        new = iter(loader)  # ends the old epoch early
        with pytest.raises(RuntimeError, match="ended early: a new iteration over the loader started"):
            next(old)
        assert sorted(i for b in new for i in b.tolist()) == list(range(40))
        with pytest.raises(StopIteration):  # an epoch that ran to its end just stops
            next(new)
