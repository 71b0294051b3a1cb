"""The lifecycle and fault suite, once per start method (``"fork"``, ``"forkserver"``, ``"spawn"``).

Workers start differently under each method: forked ones inherit the dataset and functions,
the others unpickle them (forkserver: forked from a server that preloaded the parent's
modules; spawn: a fresh interpreter), and replacements after a death start the same way,
from the coordinator thread. Every case here runs under all three: clean epochs and
``close``, a consumer that stops mid-epoch, a worker killed mid-epoch, the restart budget, an
exception in ``fn`` (raised, or skipped), ``task_timeout``, an unpicklable dataset.
A killed training process is ``test_sigkilled_parent_leaves_no_workers_and_no_files`` in
test_lifecycle.py, parametrized over the same methods (it shares that module's subprocess).

Each case checks exactly-once delivery with values equal to ``workers=0`` (faultkit), and
that no worker process and none of the loader's shared memory outlive it (besides
conftest's leak check after every test). Everything the workers run is importable from a
module (faultkit, or this one), as spawn and forkserver need. Loaders are small (two
workers, 48 samples): spawn starts each worker in about a second on a busy machine.
"""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from conftest import START_METHODS, assert_cleaned, assert_running, left_of, our_segments, our_shm_files, wait_until
from faultkit import BS, N, CrashWhileFlag, Faulty, SlowToLoad, check_epoch, reference, take

from procpipe import Loader, WorkerError

# The recovery case's timeout: above the start-up of a replacement worker, which the
# watchdog counts as task time (see test_a_slow_worker_start_is_not_a_task_timeout).
TASK_TIMEOUT_S = {"fork": 1.0, "forkserver": 1.0, "spawn": 3.0}


@pytest.fixture(params=START_METHODS)
def method(request: pytest.FixtureRequest) -> str:
    return request.param


def loader_for(method, fn=None, **kwargs):
    """A loader of ``N`` indices, batches of ``BS``, two workers started with ``method``."""
    loader = Loader(list(range(N)), fn or Faulty(), batch_size=BS, workers=2, start_method=method, **kwargs)
    assert loader.start_method == method
    return loader


def check_batch(batch, ref):
    """``batch`` holds the indices and values of ``ref``, one ``(indices, values)`` of ``reference``."""
    idx, values = take(batch)
    assert idx == ref[0]
    np.testing.assert_array_equal(values, ref[1])


# --------------------------------------------------------------------------- lifecycle
def test_clean_epochs_then_close_twice(method):
    with loader_for(method) as loader:
        pids, prefix = assert_running(loader)
        check_epoch([take(b) for b in loader], reference(0), ordered=True)
        check_epoch([take(b) for b in loader], reference(1), ordered=True)
        assert loader.worker_pids == pids, "workers were replaced between clean epochs"
    assert left_of(prefix) == [], "leaving the with block returned before releasing the shared memory"
    assert_cleaned(pids, prefix)
    loader.close()  # a second close is a no-op
    assert loader.worker_pids == []
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_consumer_stopping_mid_epoch_leaves_the_next_epoch_exact(method):
    with loader_for(method, prefetch=2) as loader:
        pids, prefix = assert_running(loader)
        epoch = 0
        for n, batch in enumerate(loader):  # break, keeping one batch
            if n == 1:
                held = batch
            if n == 3:
                break
        epoch += 1
        for _ in range(2):  # break again and again: no slot may leak
            for n, _batch in enumerate(loader):
                if n == 2:
                    break
            epoch += 1
        it = iter(loader)  # a new iter() supersedes an unfinished one
        next(it)
        epoch += 1
        del _batch, batch, it
        check_epoch([take(b) for b in loader], reference(epoch), ordered=True)
        check_epoch([take(b) for b in loader], reference(epoch + 1), ordered=True)
        check_batch(held, reference(0)[1])  # a batch kept across all that is still valid
        del held
        wait_until(lambda: loader.stats()["ring_slots_in_use"] == 0, 15, "every ring slot back on the free list")
        assert loader.worker_pids == pids
    assert_cleaned(pids, prefix)


def test_close_mid_epoch(method):
    loader = loader_for(method, prefetch=2)
    pids, prefix = assert_running(loader)
    it = iter(loader)
    kept = next(it)
    loader.close()
    assert left_of(prefix) == [], "close() returned before releasing the shared memory"
    assert_cleaned(pids, prefix)
    with pytest.raises(RuntimeError, match="ended early"):
        next(it)
    check_batch(kept, reference(0)[0])  # a batch kept past close() stays valid


# --------------------------------------------------------------------------- worker deaths
def test_workers_killed_mid_epoch_change_nothing(method, tmp_path):
    # One worker SIGKILLs itself, one exits, in fn (first attempt only); one is killed by pid
    # from the consumer's loop, once those two deaths are behind (their batches delivered).
    with loader_for(method, Faulty(tmp_path, {5: "sigkill", 30: "exit"}), prefetch=1) as loader:
        got = []
        for step, batch in enumerate(loader):
            got.append(take(batch))
            if step == 9:
                victim = loader.worker_pids[0]
                deaths = loader.stats()["worker_deaths"]
                os.kill(victim, signal.SIGKILL)
                wait_until(lambda deaths=deaths: loader.stats()["worker_deaths"] > deaths, 15, "the death to be detected")
                wait_until(lambda victim=victim: victim not in loader.worker_pids, 15, "a replacement worker")
        stats = loader.stats()
        again = [take(b) for b in loader]  # the replacements serve the next epoch
        pids, prefix = assert_running(loader)
    check_epoch(got, reference(0), ordered=True)
    check_epoch(again, reference(1), ordered=True)
    assert stats["worker_deaths"] == 3 and stats["redispatched_tasks"] >= 2
    assert_cleaned(pids, prefix)


def test_deaths_past_the_restart_budget_then_a_working_epoch(method, tmp_path):
    flag = tmp_path / "still-broken"
    flag.touch()
    with loader_for(method, CrashWhileFlag(flag, "exit"), max_worker_restarts=1) as loader:
        with pytest.raises(WorkerError) as info:
            for _ in loader:
                pass
        message = str(info.value)
        assert "exited with code 7" in message and "while loading index 5" in message, message
        assert "max_worker_restarts=1" in message, message
        flag.unlink()
        check_epoch([take(b) for b in loader], reference(1), ordered=True)
        pids, prefix = assert_running(loader)
    assert_cleaned(pids, prefix)


# --------------------------------------------------------------------------- errors in fn
def batches_or_errors(loader):
    """One epoch: ``take(batch)`` for each batch, the message of each ValueError raised instead."""
    it = iter(loader)
    while True:
        try:
            yield take(next(it))
        except StopIteration:
            return
        except ValueError as exc:
            yield str(exc)


def test_an_exception_in_fn_takes_its_batchs_place(method, tmp_path):
    with loader_for(method, Faulty(tmp_path, {9: "raise"}, once=False)) as loader:
        for epoch in range(2):  # the loader goes on after the epoch with the error
            ref = reference(epoch)
            got = list(batches_or_errors(loader))
            assert got[2] == "bad sample 9" and not any(isinstance(b, str) for b in got[:2] + got[3:]), got
            check_epoch(got[:2] + got[3:], ref, ordered=True, skipped=[8, 9, 10, 11])
            assert [idx for idx, _ in got[:2] + got[3:]] == [idx for idx, _ in ref[:2] + ref[3:]]  # in order


def test_on_error_skip_leaves_the_sample_out(method, tmp_path):
    with loader_for(method, Faulty(tmp_path, {9: "raise", 30: "raise"}, once=False), on_error="skip",
                    max_skipped=2) as loader:
        got = [take(b) for b in loader]
        assert sorted(loader.stats()["skipped"]) == [9, 30]
    check_epoch(got, reference(0), ordered=True, skipped=[9, 30])


# --------------------------------------------------------------------------- task_timeout
def test_task_timeout_kills_a_hung_worker_and_reruns_its_batch(method, tmp_path):
    never = tmp_path / "never"
    timeout = TASK_TIMEOUT_S[method]
    with loader_for(method, Faulty(tmp_path, {13: ("wait", str(never))}), task_timeout=timeout) as loader:
        pids = loader.worker_pids
        got = [take(b) for b in loader]
        stats = loader.stats()
        assert stats["timed_out_tasks"] == 1 and stats["worker_deaths"] == 1, stats
        assert len(set(loader.worker_pids) - set(pids)) == 1, "the hung worker was not replaced"
        check_epoch([take(b) for b in loader], reference(1), ordered=True)
    check_epoch(got, reference(0), ordered=True)


def test_a_slow_worker_start_is_not_a_task_timeout(method):
    """A task's time counts from the worker's WorkerReady (dataset loaded), not from its process start."""
    with Loader(SlowToLoad(range(16)), batch_size=4, workers=2, start_method=method, task_timeout=1.0) as loader:
        assert [b.tolist() for b in loader] == [list(range(k, k + 4)) for k in range(0, 16, 4)]
        assert loader.stats()["timed_out_tasks"] == 0


# --------------------------------------------------------------------------- shipping the dataset
class GeneratorSource:
    """A dataset that cannot be pickled: it holds a generator."""

    def __init__(self):
        self.stream = (i for i in range(10))

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return i


def test_an_unpicklable_dataset(method):
    before = our_shm_files(), our_segments()
    if method == "fork":  # nothing is shipped: workers inherit it
        with Loader(GeneratorSource(), batch_size=5, workers=2, start_method=method) as loader:
            assert [b.tolist() for b in loader] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    else:
        with pytest.raises(TypeError, match=r"cannot send the source.*an attribute 'stream' holds a generator") as info:
            Loader(GeneratorSource(), batch_size=5, workers=2, start_method=method)
        assert f"start_method={method!r}" in str(info.value) and "start_method='fork'" in str(info.value)
    assert (our_shm_files(), our_segments()) == before
