"""The ``workers="auto"`` policy (``procpipe._engine.policy.Tuner``) on simulated pipelines.

The tuner only sees one ``Sample`` per control interval, so its decisions can be tested
exactly, without processes or timing: a model maps a worker count to what the
coordinator would measure (throughput, consumer wait, worker busy / CPU / run-queue
time), and the tuner is stepped through simulated time. The end-to-end behaviour with
real workers is in ``test_epochs.py``; the throughput against fixed counts is measured
by ``bench/autotune.py``.
"""
from __future__ import annotations

import itertools
import re
from collections.abc import Callable

import numpy as np
import pytest

import procpipe.config
import procpipe._engine.autotune as autotune
import procpipe._engine.policy as policy
from procpipe._engine.autotune import AutoWorkers, Sample, Tuner

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)

INTERVAL = 0.25


def make_tuner(monkeypatch, cpus: int, capacity: int = 64, **settings) -> Tuner:
    monkeypatch.setattr(autotune, "cpu_count", lambda: cpus)
    monkeypatch.setattr(procpipe.config, "cpu_count", lambda: cpus)  # AutoWorkers.first, hard_max
    auto = AutoWorkers(**settings)
    return Tuner(auto.min, auto.hard_max, capacity=capacity, workers=auto.first, started=0.0, cpus=cpus)


def simulate(tuner: Tuner, model: Callable[[int], Sample], seconds: float, memory_fits: int | None = None,
             start: float = 0.0) -> list[int]:
    """Step the tuner through ``seconds`` of intervals; the worker count in force in each one.

    ``memory_fits``: the most workers available memory holds; the room left is given to
    the tuner before every interval, as the coordinator does (``autotune.memory_room``).
    """
    counts, now, n = [], start, tuner.workers
    while now < start + seconds:
        now += INTERVAL
        counts.append(n)
        if memory_fits is not None:
            tuner.memory_room = memory_fits - n
        n = tuner.step(now, model(n))
        assert n == tuner.workers
    return counts


def cpu_bound(cpus: int, per_worker: float = 100.0) -> Callable[[int], Sample]:
    """Each worker adds ``per_worker`` batches/s up to the CPUs; beyond, they queue for a CPU."""
    def model(n: int) -> Sample:
        on_cpu = min(n, cpus)
        return Sample(INTERVAL, per_worker * on_cpu, wait=0.4, busy=float(n), cpu=float(on_cpu),
                      runq=float(n - on_cpu))
    return model


def io_bound(saturates_at: int, per_worker: float = 50.0) -> Callable[[int], Sample]:
    """Workers mostly sleep (I/O); throughput grows with them up to ``saturates_at``."""
    def model(n: int) -> Sample:
        return Sample(INTERVAL, per_worker * min(n, saturates_at), wait=0.4, busy=float(n), cpu=0.1 * n)
    return model


def changes(counts: list[int]) -> int:
    return sum(a != b for a, b in itertools.pairwise(counts))


def test_cpu_bound_grows_to_the_cpu_count_and_no_further(monkeypatch):
    tuner = make_tuner(monkeypatch, cpus=4, start=1)
    counts = simulate(tuner, cpu_bound(cpus=4), seconds=60)
    assert counts[0] == 1
    assert max(counts) == 4 and counts[-1] == 4, counts
    assert not tuner.io_bound and not tuner.contended
    assert counts.index(4) * INTERVAL < 5, "took too long to reach the CPU count"


def test_io_bound_goes_beyond_the_cpus_to_where_throughput_stops_growing(monkeypatch):
    tuner = make_tuner(monkeypatch, cpus=2, start=2, max=12)
    counts = simulate(tuner, io_bound(saturates_at=6), seconds=120)
    assert tuner.io_bound
    assert counts[-1] == 6, counts[-40:]
    # Doubling from 4 overshoots to 8 (no better than 6): the knee is bisected back (8 -> 6 -> 5 -> 6).
    assert max(counts) == 8, "grew further than one doubling past the point where throughput stopped growing"
    assert counts.index(6) * INTERVAL <= 3.0, counts[:20]
    # 7 did not help: it is retried only after a backoff that doubles (2 s, 4 s, ... at most 60 s).
    tries = sum(1 for a, b in itertools.pairwise(counts) if a == 6 and b == 7)
    assert 1 <= tries <= 6, tries


def test_a_worker_that_does_not_help_is_removed_and_not_retried_at_once(monkeypatch):
    tuner = make_tuner(monkeypatch, cpus=4, start=2)
    flat = lambda n: Sample(INTERVAL, 200.0, wait=0.4, busy=float(n), cpu=float(n))  # noqa: E731
    counts = simulate(tuner, flat, seconds=10)
    # 4 (a doubling) is tried and undone, then 3 (halfway): neither is kept
    assert max(counts) == 4 and counts.count(2) >= 0.7 * len(counts), counts
    first_try = counts.index(3)
    back = counts.index(2, first_try)
    retry = counts.index(3, back) if 3 in counts[back:] else len(counts)
    assert (retry - back) * INTERVAL >= policy.BACKOFF_S


def test_noise_alone_does_not_make_it_thrash(monkeypatch):
    rng = np.random.default_rng(0)
    tuner = make_tuner(monkeypatch, cpus=2, start=2)
    noisy = lambda n: Sample(INTERVAL, 500.0 * rng.uniform(0.9, 1.1), wait=0.3, busy=0.9 * n,  # noqa: E731
                             cpu=0.9 * n)
    counts = simulate(tuner, noisy, seconds=120)
    assert set(counts) <= {1, 2, 3}
    assert changes(counts) <= 30, f"{changes(counts)} changes in 480 intervals of pure noise"


def test_when_workers_idle_while_the_consumer_waits_it_tries_fewer(monkeypatch):
    """The engine's own per-batch work is the limit (tiny samples): a worker fewer costs nothing."""
    tuner = make_tuner(monkeypatch, cpus=2, start=2)
    engine_bound = lambda n: Sample(INTERVAL, 1000.0 if n == 1 else 900.0, wait=0.3, busy=0.2 * n,  # noqa: E731
                                    cpu=0.2 * n)
    counts = simulate(tuner, engine_bound, seconds=20)
    assert counts[-1] == 1 and max(counts) == 2


def test_with_idle_workers_it_still_comes_back_up_when_fewer_stop_paying_off(monkeypatch):
    """Tiny samples: one worker was best, then other processes load the CPUs and two win."""
    tuner = make_tuner(monkeypatch, cpus=2, start=2)
    best = {"n": 1}
    engine_bound = lambda n: Sample(INTERVAL, 1000.0 if n == best["n"] else 800.0, wait=0.3,  # noqa: E731
                                    busy=0.2 * n, cpu=0.2 * n)
    counts = simulate(tuner, engine_bound, seconds=20)
    assert counts[-1] == 1
    best["n"] = 2
    counts = simulate(tuner, engine_bound, seconds=80, start=20)
    assert counts[-40:].count(2) >= 30, counts  # (one fewer is re-tried now and then, after a backoff)
    assert counts.index(2) * INTERVAL <= policy.BACKOFF_MAX_S


def test_with_idle_workers_noise_does_not_bring_back_a_worker_that_costs(monkeypatch):
    """Tiny samples on a noisy machine: one worker is 10 % faster than two, and the machine's
    speed drifts by up to +-20 % from one second to the next (noise that lasts, as real load
    does). The tuner may re-try two workers now and then, but must not keep them on noise."""
    at_two = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        drift = np.repeat(rng.uniform(0.8, 1.2, 120), 4)  # one factor per second of 4 intervals
        steps = iter(drift)
        tuner = make_tuner(monkeypatch, cpus=2, start=2)
        model = lambda n, steps=steps: Sample(INTERVAL, (1000.0 if n == 1 else 900.0) * next(steps),  # noqa: E731
                                 wait=0.3, busy=0.2 * n, cpu=0.2 * n)
        counts = simulate(tuner, model, seconds=119)
        at_two.append(counts.count(2) / len(counts))
    assert np.mean(at_two) < 0.045, f"share of intervals at 2 workers, per seed: {np.round(at_two, 3)}"


def test_a_worker_is_not_kept_for_a_gain_smaller_than_the_noise(monkeypatch):
    """Tiny samples: one worker is faster on average, but swings between 0.5x and 1.4x from one
    second to the next (whether the consumer shares its CPU); two are steady and slower. A
    trial of two during a slow second must not keep them: the gain must beat the noise."""
    at_one = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        regime = iter(np.repeat(rng.uniform(0.5, 1.4, 61), 4))  # one speed per second of 4 intervals
        tuner = make_tuner(monkeypatch, cpus=2, start=2)
        model = lambda n, regime=regime, rng=rng: Sample(INTERVAL, 1000.0 * next(regime) if n == 1 else 780.0 * rng.uniform(0.95, 1.05),  # noqa: E731
                                 wait=0.3, busy=0.2 * n, cpu=0.2 * n)
        counts = simulate(tuner, model, seconds=60)
        at_one.append(counts.count(1) / len(counts))
    assert np.mean(at_one) >= 0.92, f"share of intervals at 1 worker, per seed: {np.round(at_one, 2)}"


def test_it_retires_workers_the_consumer_does_not_need(monkeypatch):
    tuner = make_tuner(monkeypatch, cpus=4, start=4)
    slow_consumer = lambda n: Sample(INTERVAL, 100.0, wait=0.0, busy=0.3, cpu=0.3)  # noqa: E731
    counts = simulate(tuner, slow_consumer, seconds=30)
    assert counts[-1] == 1 and counts == sorted(counts, reverse=True)
    # one at a time, each after SHRINK_AFTER intervals of spare capacity
    assert changes(counts) == 3


@pytest.mark.parametrize("limit", ["max", "capacity", "memory", "min"])
def test_bounds_are_never_crossed(monkeypatch, limit):
    settings = {"start": 2}
    capacity = 64
    if limit == "max":
        settings["max"] = 3
    elif limit == "min":
        settings["min"] = 3
    elif limit == "capacity":
        capacity = 3
    tuner = make_tuner(monkeypatch, cpus=2, capacity=capacity, **settings)
    model = io_bound(saturates_at=20) if limit != "min" else (
        lambda n: Sample(INTERVAL, 100.0, wait=0.0, busy=0.1, cpu=0.1))
    counts = simulate(tuner, model, seconds=60, memory_fits=3 if limit == "memory" else None)
    assert min(counts) >= tuner.min
    if limit == "min":
        assert counts[0] == 3 and set(counts) == {3}
    else:
        assert max(counts) == 3 and counts[-1] == 3, counts


def test_memory_that_runs_short_brings_the_count_down(monkeypatch):
    tuner = make_tuner(monkeypatch, cpus=2, start=2, max=8)
    counts = simulate(tuner, io_bound(saturates_at=20), seconds=20, memory_fits=100)
    assert counts[-1] == 8
    # other processes took memory: it now holds five workers
    counts = simulate(tuner, io_bound(saturates_at=20), seconds=5, memory_fits=5, start=20)
    assert counts[-1] == 5 and counts == sorted(counts, reverse=True), counts
    assert changes(counts) == 1  # at once


def test_contended_cpus_allow_one_worker_beyond_them(monkeypatch):
    """Other processes hold the CPUs (workers queue for them): one more worker is tried."""
    tuner = make_tuner(monkeypatch, cpus=2, start=2)
    def shared(n: int) -> Sample:  # each extra worker wins a larger share of the contended CPUs
        return Sample(INTERVAL, 100.0 * n, wait=0.4, busy=float(n), cpu=0.6 * n, runq=0.4 * n)
    counts = simulate(tuner, shared, seconds=20)
    assert tuner.contended and not tuner.io_bound
    assert max(counts) == 3 and counts[-1] == 3


def test_the_trace_records_every_interval(monkeypatch):
    tuner = make_tuner(monkeypatch, cpus=4, start=1)
    counts = simulate(tuner, cpu_bound(cpus=4), seconds=5)
    info = tuner.info(tuner.workers)
    assert [entry[1] for entry in info["trace"]] == counts
    assert info["changes"] == changes(counts) and info["limit"] == 4 and info["cpus"] == 4


@pytest.mark.parametrize("available_gib, expected", [(10.0, 6), (2.6, 0), (1.0, -1)])
def test_memory_room_counts_workers_that_fit_or_must_go(monkeypatch, available_gib, expected):
    """A budget of 16 GiB (a cgroup's limit, or the machine's memory) keeps a 1.6 GiB reserve; each
    worker holds 1.4 GiB."""
    from procpipe._core.memory_budget import MemoryBudget

    gib = 2**30
    budget = MemoryBudget(int(available_gib * gib), 16 * gib, "a test's budget")
    monkeypatch.setattr(autotune, "memory_budget", lambda: budget)
    assert autotune.memory_room(int(1.4 * gib)) == expected


@pytest.mark.parametrize("settings, message", [
    ({"start": 0}, "AutoWorkers: start must be an int >= 1, got 0"),
    ({"min": True}, "AutoWorkers: min must be an int >= 1, got True"),
    ({"min_batches": 2.0}, "AutoWorkers: min_batches must be an int >= 1, got 2.0"),
    ({"min": 3, "max": 2}, "AutoWorkers: max must be an int >= 3 or None, got 2"),
    ({"interval": 0}, "AutoWorkers: interval must be a number of seconds > 0, got 0"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AutoWorkers(**settings)
