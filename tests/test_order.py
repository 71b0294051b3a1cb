"""Which batches an epoch yields, and in which order: ``ordered`` in the order's sequence, ``ordered=False``
exactly once, ``len()``, identical output for any worker count, ``shuffle``/``seed``/``set_epoch``, a
superseded iterator, and ``batches=``'s indices checked."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import (
    to_py,
)

import procpipe
from procpipe import Loader


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


N, BS = 40, 4


class TwoBatches:
    def __init__(self, first):
        self.first = first

    def __len__(self):
        return 2

    def __call__(self, epoch):
        return [[self.first], [0]]


@pytest.mark.parametrize("index", [True, np.True_])
def test_a_boolean_is_not_an_index_in_batches(index):
    with Loader(list(range(N)), batch_size=None, workers=0, batches=TwoBatches(index)) as loader:
        with pytest.raises(TypeError, match="integer indices"):
            list(loader)
