"""Loader.stats(): the numbers agree with what the consumer actually received."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import leaves

from procpipe import Loader

FRACTIONS = ("wait_fraction", "ring_occupancy", "ring_peak_occupancy", "worker_busy_fraction")


class Records:
    """Samples with arrays whose sizes are not multiples of 64 (so padding would show)."""

    def __init__(self, n, width=3):
        self.n = n
        self.width = width

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"x": np.full(self.width, i, dtype=np.float32), "y": i, "name": f"s{i}"}


def array_bytes(batch):
    return sum(a.nbytes for a in leaves(batch) if isinstance(a, np.ndarray))


def consume(loader):
    """One epoch: (batches, samples, array bytes) as the consumer saw them."""
    batches = samples = nbytes = 0
    for batch in loader:
        batches += 1
        samples += len(batch["y"])
        nbytes += array_bytes(batch)
    return batches, samples, nbytes


def check_invariants(s):
    json.dumps(s)  # a plain dict
    for key in FRACTIONS:
        assert 0.0 <= s[key] <= 1.0, (key, s[key])
    for w in s["per_worker"]:
        assert 0.0 <= w["busy_fraction"] <= 1.0
        assert w["tasks"] <= w["tasks_total"]
    assert 0.0 <= s["wait_s"] <= s["wall_s"] + 1e-6
    assert s["batches_consumed"] <= s["batches"]
    assert s["ring_slots_in_use"] <= s["ring_slots"]
    assert s["ring_peak_slots_in_use"] <= s["ring_slots"]


def test_stats_before_first_epoch():
    with Loader(Records(10), batch_size=4, workers=0) as loader:
        s = loader.stats()
    assert s["epoch"] is None and s["running"] is False
    assert s["batches"] == s["samples"] == s["bytes"] == 0
    check_invariants(s)


@pytest.mark.parametrize("ordered", [True, False])
def test_stats_match_delivered_batches(ordered):
    n, bs = 203, 8
    with Loader(Records(n), batch_size=bs, workers=2, ordered=ordered) as loader:
        batches, samples, nbytes = consume(loader)
        s = loader.stats()
        check_invariants(s)
        assert (batches, samples) == (len(loader), n)
        assert s["epoch"] == 0 and s["running"] is False and s["workers"] == 2
        assert s["batches"] == s["batches_consumed"] == batches
        assert s["samples"] == samples
        assert s["bytes"] == nbytes  # exact .nbytes, no alignment padding
        assert s["bytes_in_slots"] + s["bytes_inline"] >= nbytes
        assert s["overflow_batches"] == 0
        assert len(s["per_worker"]) == 2
        assert sum(w["tasks"] for w in s["per_worker"]) == s["worker_tasks"] == batches
        assert sorted(w["pid"] for w in s["per_worker"]) == sorted(loader.worker_pids)
        assert s["ring_slots"] > 0 and s["ring_slot_bytes"] > 0 and s["ring_peak_slots_in_use"] >= 1
        assert s["wall_s"] > 0 and s["samples_per_s"] > 0 and s["bytes_per_s"] > 0

        # The second epoch is counted on its own; per-worker totals keep growing.
        batches2, samples2, nbytes2 = consume(loader)
        s2 = loader.stats()
        check_invariants(s2)
        assert s2["epoch"] == 1
        assert (s2["batches"], s2["samples"], s2["bytes"]) == (batches2, samples2, nbytes2)
        assert sum(w["tasks"] for w in s2["per_worker"]) == batches2
        assert sum(w["tasks_total"] for w in s2["per_worker"]) == batches + batches2


def test_stats_mid_epoch():
    with Loader(Records(64), batch_size=4, workers=2) as loader:
        it = iter(loader)
        taken = [next(it) for _ in range(3)]
        s = loader.stats()
        check_invariants(s)
        assert s["running"] is True and s["epoch"] == 0
        assert s["batches_consumed"] == 3
        assert 3 <= s["batches"] <= len(loader)
        assert s["bytes"] >= sum(array_bytes(b) for b in taken)
        del taken
        rest = sum(1 for _ in it)
        s = loader.stats()
        assert s["running"] is False and s["batches"] == s["batches_consumed"] == 3 + rest


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_stats_count_overflowing_batches():
    # slot_bytes is rounded up to one page; each batch (8 x 300 float32 = 9600 B) overflows it.
    n, bs = 40, 8
    with Loader(Records(n, width=300), batch_size=bs, workers=2, slot_bytes=64) as loader:
        batches, samples, nbytes = consume(loader)
        s = loader.stats()
    check_invariants(s)
    assert s["batches"] == batches and s["samples"] == samples == n
    assert s["bytes"] == nbytes
    assert s["overflow_batches"] >= 1
    assert s["bytes_inline"] >= nbytes and s["bytes_in_slots"] == 0


def test_stats_without_workers():
    n, bs = 50, 7
    with Loader(Records(n), batch_size=bs, workers=0) as loader:
        it = iter(loader)
        next(it)
        mid = loader.stats()
        assert mid["running"] is True and mid["batches"] == mid["batches_consumed"] == 1
        batches, samples, nbytes = consume(loader)
        s = loader.stats()
    check_invariants(s)
    assert s["workers"] == 0 and s["per_worker"] == [] and s["worker_busy_fraction"] == 0.0
    assert s["epoch"] == 1 and s["running"] is False
    assert (s["batches"], s["samples"], s["bytes"]) == (batches, samples, nbytes)
    assert s["batches_consumed"] == batches
    assert s["ring_slots"] == 0 and s["bytes_inline"] == 0 and s["overflow_batches"] == 0
    assert 0.0 < s["wait_s"] <= s["wall_s"]  # with workers=0, next() does the loading
