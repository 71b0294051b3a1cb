"""Epoch control (reshuffle, epochs=N / None, with_epoch, resume mid-stream) and workers="auto".

Assertions are structural: orders and counts, epoch tags, file markers written by ``fn``,
the autotuner's trace. No timing thresholds; sleeps only inside ``fn`` or the training step,
to model work.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter

import numpy as np
import pytest
from conftest import wait_gone, wait_until

import procpipe
from procpipe import AutoWorkers, Loader

N, BS = 40, 4  # 10 batches per epoch


def sample(i):
    """A sample whose value depends on (seed, epoch, index) through sample_rng()."""
    return {"i": i, "r": procpipe.sample_rng().integers(1 << 30)}


def key(batch):
    return (tuple(int(x) for x in batch["i"]), tuple(int(x) for x in batch["r"]))


def by_epoch(pairs):
    out = {}
    for epoch, batch in pairs:
        out.setdefault(epoch, []).append(key(batch) if isinstance(batch, dict) else batch)
    return out


def indices(batches):
    return sorted(i for b in batches for i in b[0])


def separate(epochs, **kwargs):
    """Reference: one plain iteration per epoch (epochs=1), workers=0."""
    with Loader(list(range(N)), sample, batch_size=BS, workers=0, **kwargs) as loader:
        return {e: [key(b) for b in loader] for e in range(epochs)}


# --------------------------------------------------------------------------- keep one order
@pytest.mark.parametrize("workers", [0, 2])
def test_reshuffle_false_keeps_epoch_zero_order_but_samples_change(workers):
    with Loader(list(range(N)), sample, batch_size=BS, workers=workers, shuffle=True, seed=3,
                reshuffle=False) as loader:
        runs = [[key(b) for b in loader] for _ in range(3)]
    orders = [[k[0] for k in run] for run in runs]
    assert orders[0] == orders[1] == orders[2]
    assert orders[0] != [tuple(range(k, k + BS)) for k in range(0, N, BS)]  # shuffled all the same
    assert [k[1] for k in runs[0]] != [k[1] for k in runs[1]]  # sample_rng still varies by epoch
    with Loader(list(range(N)), sample, batch_size=BS, workers=0, shuffle=True, seed=3) as reshuffled:
        order0, order1 = ([key(b)[0] for b in reshuffled] for _ in range(2))
    assert order0 == orders[0] and order1 != order0  # epoch 0 is the same permutation either way


def test_bad_epoch_arguments():
    for kwargs in ({"epochs": 0}, {"epochs": True}, {"epochs": 1.5}, {"workers": "many"},
                   {"reshuffle": "no"}, {"with_epoch": 1}):
        with pytest.raises((ValueError, TypeError)):
            Loader(list(range(N)), batch_size=BS, **kwargs)
    with pytest.raises(ValueError, match="reshuffle"):
        Loader(list(range(N)), batch_size=BS, batches=lambda e: [[0]], reshuffle=False)
    for kwargs in ({"max": 0}, {"start": 0}, {"min": 3, "max": 2}, {"interval": 0}):
        with pytest.raises(ValueError):
            AutoWorkers(**kwargs)


# --------------------------------------------------------------------------- epochs=N
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_epochs_n_is_exactly_once_per_epoch_and_matches_separate_iterations(ordered, workers):
    ref = separate(5, shuffle=True, seed=5)
    with Loader(list(range(N)), sample, batch_size=BS, workers=workers, shuffle=True, seed=5, ordered=ordered,
                epochs=3, with_epoch=True) as loader:
        first = list(loader)
        assert loader.epoch == 3
        assert loader.stats()["epoch"] == 2
        second = list(loader)  # the next iteration continues with epochs 3 and 4 (then 5)
        assert loader.epoch == 6
    tags = [e for e, _ in first]
    assert tags == sorted(tags) if ordered else sorted(set(tags)) == [0, 1, 2]
    got = by_epoch(first)
    assert sorted(got) == [0, 1, 2]
    for e, batches in got.items():
        assert indices(batches) == list(range(N)), f"epoch {e} is not exactly once"
        if ordered:
            assert batches == ref[e]
        else:
            assert sorted(batches) == sorted(ref[e])
    assert [e for e, _ in second][0] == 3 and set(by_epoch(second)) == {3, 4, 5}
    if ordered:
        assert by_epoch(second)[4] == ref[4]


def test_with_epoch_through_the_device_stage():
    import torch

    with Loader(list(range(N)), sample, batch_size=BS, workers=2, epochs=2, with_epoch=True, device="cpu") as loader:
        got = list(loader)
    assert [e for e, _ in got] == [0] * 10 + [1] * 10
    assert all(isinstance(b["i"], torch.Tensor) for _, b in got)


def test_epoch_tags_and_loader_epoch_without_with_epoch():
    with Loader(list(range(N)), sample, batch_size=BS, workers=2, epochs=2) as loader:
        seen = []
        for batch in loader:
            seen.append((loader.epoch - 1, key(batch)))  # loader.epoch: the one after the last batch's
        assert [e for e, _ in seen] == [0] * 10 + [1] * 10
        s = loader.stats()
        assert s["epoch"] == 1 and s["batches"] == 10 and not s["running"]


# --------------------------------------------------------------------------- no stall at the boundary
class EpochFromIndex:
    """``batches=``: epoch ``e`` loads indices ``e*N .. e*N+N-1``, so an index names its epoch."""

    def __init__(self, epochs):
        self.epochs = epochs

    def __len__(self):
        return N // BS

    def __call__(self, epoch):
        base = epoch * N
        return [list(range(base + k, base + k + BS)) for k in range(0, N, BS)]


class WaitForNextEpoch:
    """The last sample of each epoch waits (up to 30 s) until a sample of the next epoch has
    started (a marker file). Draining at the boundary would make it time out."""

    def __init__(self, directory, last):
        self.directory = str(directory)
        self.last = last  # the stream's last epoch (None: endless), which has no next one

    def __call__(self, i):
        epoch, position = divmod(i, N)
        open(os.path.join(self.directory, f"started-{epoch}"), "a").close()
        waited_out = False
        if position == N - 1 and epoch != self.last:
            marker = os.path.join(self.directory, f"started-{epoch + 1}")
            deadline = time.monotonic() + 30.0
            while not os.path.exists(marker):
                if time.monotonic() > deadline:
                    waited_out = True
                    break
                time.sleep(0.002)  # polls a file written by another worker: models an I/O wait
        return {"i": i, "stalled": waited_out}


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("epochs", [3, None])
def test_next_epoch_is_dispatched_while_the_last_batch_still_runs(tmp_path, ordered, epochs):
    fn = WaitForNextEpoch(tmp_path, None if epochs is None else epochs - 1)
    with Loader(list(range(10 * N)), fn, batch_size=BS, workers=2, ordered=ordered, epochs=epochs,
                batches=EpochFromIndex(10), with_epoch=True) as loader:
        got = []
        for epoch, batch in loader:
            got.append((epoch, batch["i"].tolist(), batch["stalled"].tolist()))  # (slots go back to the ring)
            if epochs is None and all(sum(1 for g in got if g[0] == e) == N // BS for e in range(3)):
                break
    for e in range(3):
        batches = [g for g in got if g[0] == e]
        assert sorted(i for g in batches for i in g[1]) == list(range(e * N, e * N + N))
        assert not any(any(g[2]) for g in batches), f"the last batch of epoch {e} waited for epoch {e + 1}"


# --------------------------------------------------------------------------- endless stream
@pytest.mark.parametrize("ordered", [True, False])
def test_breaking_out_of_an_endless_stream_cleans_up(ordered):
    with Loader(list(range(N)), sample, batch_size=BS, workers=2, ordered=ordered, epochs=None,
                with_epoch=True, shuffle=True) as loader:
        pids = loader.worker_pids
        got = []
        for epoch, batch in loader:
            got.append((epoch, key(batch)))
            if len(got) == 35:  # into epoch 3
                break
        del batch
        last = max(e for e, _ in got)
        assert last >= 3 and loader.epoch == last + 1
        # The broken-off stream stays bounded (by the ring) until something ends it, as a
        # broken-off epoch does; load_state_dict() ends it, and every slot comes back.
        state = loader.state_dict()
        complete = [e for e, n in sorted(Counter(e for e, _ in got).items()) if n == N // BS]
        assert state["until"] is None and state["epoch"] == min(set(range(last + 1)) - set(complete))
        loader.load_state_dict(state)
        ring = loader._coordinator.ring
        wait_until(lambda: len(ring.free) == ring.slots, 10, "every ring slot back after the break")
        it = iter(loader)  # resumes where we broke off, then goes on forever
        # Until epochs 0-3 are complete: sloppy, a batch of epoch 0 may come after any number of
        # later ones (test_sloppy_overlap.py holds one back on purpose), so no fixed count is enough.
        rest = []
        while any(len(by_epoch(got + rest).get(e, ())) < N // BS for e in range(4)):
            assert len(rest) < 2000, f"epochs 0-3 not complete after the resume: {Counter(e for e, _ in got + rest)}"
            rest += [(e, key(b)) for e, b in [next(it)]]
        full = by_epoch(got + rest)
        for e in range(4):
            assert indices(full[e]) == list(range(N)), f"epoch {e}"
        assert all(len(batches) <= N // BS for batches in full.values())
        if ordered:
            assert [e for e, _ in got + rest] == sorted(e for e, _ in got + rest)
        assert next(iter(loader))[0] == max(full) + 1  # a new iteration: after the last batch's epoch
        assert loader.worker_pids == pids
    assert wait_gone(pids) == []


def test_endless_stream_without_workers_and_an_empty_source():
    with Loader(list(range(N)), sample, batch_size=BS, workers=0, epochs=None, with_epoch=True) as loader:
        got = [next(it) for it in [iter(loader)] for _ in range(25)]
    assert [e for e, _ in got] == [0] * 10 + [1] * 10 + [2] * 5
    for workers in (0, 2):
        with Loader([], batch_size=BS, workers=workers, epochs=None) as loader:
            assert list(loader) == []  # an empty epoch ends an endless stream instead of spinning


# --------------------------------------------------------------------------- resume mid-stream
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("workers_after", [0, 1, 3])
def test_resume_in_a_multi_epoch_stream(ordered, workers_after):
    ref = separate(4, shuffle=True, seed=9)
    with Loader(list(range(N)), sample, batch_size=BS, workers=2, shuffle=True, seed=9, ordered=ordered,
                epochs=4, with_epoch=True) as first:
        it = iter(first)
        before = [next(it) for _ in range(17)]  # epoch 0, and 7 batches of epoch 1
        state = json.loads(json.dumps(first.state_dict()))
    assert state["until"] == 4 and state["epoch"] in (0, 1)
    with Loader(list(range(N)), sample, batch_size=BS, workers=workers_after, shuffle=True, seed=9,
                ordered=ordered, epochs=4, with_epoch=True) as second:
        second.load_state_dict(state)
        assert second.state_dict() == state
        after = list(second)
        assert second.epoch == 4
        following = list(second)  # then the loader's own epochs: 4 .. 7
    got = by_epoch(before + after)
    assert sorted(got) == [0, 1, 2, 3]
    for e in range(4):
        if ordered:
            assert got[e] == ref[e]
        else:
            assert sorted(got[e]) == sorted(ref[e])
    assert sorted(by_epoch(following)) == [4, 5, 6, 7]


class SlowFirstBatch:
    """Index 0 (in batch 0 of epoch 0 only, with ``EpochFromIndex``) waits for a release file
    written by the test, so that a sloppy stream delivers batches of epoch 1 before epoch 0
    is complete."""

    def __init__(self, release):
        self.release = str(release)

    def __call__(self, i):
        if i == 0:
            while not os.path.exists(self.release):
                time.sleep(0.002)  # an I/O-like stall, released by the consumer
        return sample(i)


def test_sloppy_resume_remembers_batches_of_the_next_epoch(tmp_path):
    release = tmp_path / "release"
    source = list(range(3 * N))
    with Loader(source, SlowFirstBatch(release), batch_size=BS, workers=2, ordered=False, epochs=3,
                with_epoch=True, batches=EpochFromIndex(3)) as first:
        it = iter(first)
        before = []
        while not any(e == 1 for e, _ in before):
            before.append(next(it))
        state = json.loads(json.dumps(first.state_dict()))
        release.touch()
    assert state["epoch"] == 0 and state["done_below"] == 0 and 0 not in state["done"]
    assert state["ahead"] and state["ahead"][0][0] == 1
    with Loader(source, sample, batch_size=BS, workers=1, ordered=False, epochs=3, with_epoch=True,
                batches=EpochFromIndex(3)) as second:
        second.load_state_dict(state)
        after = list(second)
    with Loader(source, sample, batch_size=BS, workers=0, batches=EpochFromIndex(3)) as reference:
        ref = {e: sorted(key(b) for b in reference) for e in range(3)}
    got = by_epoch(before + after)
    assert {e: sorted(b) for e, b in got.items()} == ref


# --------------------------------------------------------------------------- autotune
def io_bound(i):
    time.sleep(0.004)  # models an I/O wait: the worker is busy but not on a CPU
    return i


def cpu_bound(i):
    x = 0
    for k in range(20_000):  # pure Python holding the GIL: ~1-2 ms
        x = (x * 31 + k) & 0xFFFF
    return i


FAST = {"interval": 0.05, "min_batches": 4}


def run_until(loader, condition, limit):
    """Consume the endless stream until ``condition(stats)`` holds or ``limit`` batches."""
    seen = set()
    for n, (epoch, _batch) in enumerate(loader):
        seen.add(epoch)
        s = loader.stats()
        if condition(s) or n >= limit:
            return s, seen
    raise AssertionError("the stream ended")


def trace_workers(s):
    return [entry[1] for entry in s["autotune"]["trace"]]


def test_autotune_grows_on_io_bound_work_within_bounds(tmp_path):
    # (a shm_dir of its own: auto-tuned loaders sharing one split its CPUs, and another test's may run beside it)
    with Loader(list(range(400)), io_bound, batch_size=4, workers=AutoWorkers(start=1, max=3, **FAST),
                epochs=None, with_epoch=True, shm_dir=str(tmp_path)) as loader:
        assert loader.stats()["workers"] == 1 and len(loader.worker_pids) == 1
        s, _ = run_until(loader, lambda s: len(s["autotune"]["trace"]) >= 12 and s["workers"] == 3, 5000)
        counts = trace_workers(s)
        assert s["autotune"]["max"] == 3
        assert all(1 <= c <= 3 for c in counts), counts
        assert max(counts) > 1, f"never grew on I/O-bound work with an idle consumer: {s['autotune']}"
        assert 1 <= s["workers"] <= 3 and len(loader.worker_pids) <= 3
        for entry in s["autotune"]["trace"]:
            t, workers, rate, wait = entry
            assert t >= 0 and rate >= 0 and 0 <= wait <= 1
        json.dumps(s)


def test_autotune_grows_on_cpu_bound_work_up_to_the_cpus(tmp_path):
    cpus = procpipe._engine.autotune.cpu_count()
    # (a shm_dir of its own: an auto-tuned loader of another test running beside it in the same shm_dir
    # would take half the CPU budget through the node file, and this test is about one loader alone)
    with Loader(list(range(200)), cpu_bound, batch_size=4, workers=AutoWorkers(start=1, **FAST),
                epochs=None, with_epoch=True, shm_dir=str(tmp_path)) as loader:
        s, _ = run_until(loader, lambda s: len(s["autotune"]["trace"]) >= 16, 5000)
        counts = trace_workers(s)
    assert max(counts) <= max(cpus, 1) + 1  # CPU-bound: at most one probe beyond the CPUs (then back)
    assert not s["autotune"]["io_bound"]
    if cpus >= 2:
        assert max(counts) >= 2, f"never grew on CPU-bound work with an idle consumer: {s['autotune']}"
    else:
        assert max(counts) == 1


def test_autotune_does_not_grow_when_the_consumer_is_the_bottleneck():
    with Loader(list(range(400)), batch_size=4, workers=AutoWorkers(start=2, max=4, **FAST),
                epochs=None, with_epoch=True) as loader:
        for _ in loader:
            time.sleep(0.01)  # the training step: far slower than loading 4 indices
            if len(loader.stats()["autotune"]["trace"]) >= 10:
                break
        s = loader.stats()
    assert max(trace_workers(s)) <= 2, s["autotune"]


def test_autotune_retires_idle_workers_and_every_epoch_stays_exactly_once():
    with Loader(list(range(N)), sample, batch_size=BS, workers=AutoWorkers(start=2, max=3, **FAST),
                epochs=None, with_epoch=True) as loader:
        pids = set(loader.worker_pids)
        assert len(pids) == 2
        got = []
        for epoch, batch in loader:
            got.append((epoch, key(batch)))
            time.sleep(0.01)  # a slow training step: the workers mostly idle
            if loader.stats()["workers"] == 1 and len(got) % (N // BS) == 0:
                break
        s = loader.stats()
        counts = trace_workers(s)
        assert counts[0] == 2 and max(counts) <= 2 and s["workers"] == 1 and s["autotune"]["changes"] >= 1
        # stats() counts the workers autotune keeps; a retired one leaves the roster once its
        # last task is back (under load, after the loop above has seen the count drop)
        gone = wait_until(lambda: pids - set(loader.worker_pids), what="the retired worker to leave the roster")
        assert wait_gone(gone) == []  # retired workers exit
    full = by_epoch(got)
    for e, batches in full.items():
        assert indices(batches) == list(range(N)), f"epoch {e}"


def test_workers_auto_is_accepted_and_zero_workers_is_unchanged():
    with Loader(list(range(N)), batch_size=BS, workers="auto") as loader:
        assert indices_of(list(loader)) == list(range(N))
        s = loader.stats()
        assert s["autotune"]["workers"] == s["workers"] >= 1
        assert s["autotune"]["max"] >= s["autotune"]["limit"] >= 1
    with Loader(list(range(N)), batch_size=BS, workers=0) as loader:
        assert indices_of(list(loader)) == list(range(N))
        assert loader.stats()["workers"] == 0 and loader.stats()["autotune"] is None
    with Loader(list(range(N)), batch_size=BS, workers=2) as loader:
        list(loader)
        assert loader.stats()["autotune"] is None


def indices_of(batches):
    return sorted(int(i) for b in batches for i in np.asarray(b))


def test_autotuned_loaders_share_the_node_file_and_leave_nothing_behind(tmp_path):
    """Two auto-tuned loaders iterating at once (a train and a validation loader) split this
    process's CPU budget through the node file in shm_dir; closed, they leave nothing there."""
    budget = procpipe._engine.autotune.cpu_count()
    half = max(1.0, budget / 2)
    make = lambda: Loader(list(range(400)), io_bound, batch_size=4, shm_dir=str(tmp_path),  # noqa: E731
                          workers=AutoWorkers(start=1, max=3, **FAST), epochs=None, with_epoch=True)
    with make() as train, make() as val:
        a, b = iter(train), iter(val)
        for _ in range(5000):
            next(a), next(b)
            sa, sb = train.stats()["autotune"], val.stats()["autotune"]
            if len(sa["trace"]) >= 8 and len(sb["trace"]) >= 8 and sa["cpus"] == sb["cpus"] == half:
                break
        assert sa["cpus"] == sb["cpus"] == half, (sa["cpus"], sb["cpus"])
        names = [n for n in os.listdir(tmp_path) if "-node-" in n]
        assert len(names) == 1
        with open(tmp_path / names[0]) as f:
            assert len(f.read().splitlines()) == 2
        for s in (sa, sb):
            assert 1 <= s["workers"] <= 3 and s["target"] >= 1 and 0 < s["cpu_per_worker"] <= 1
    assert os.listdir(tmp_path) == []
