"""``workers="auto"`` on simulated nodes of 16 to 96 CPUs: how fast and how close it gets.

The policy (``procpipe._engine.policy.Tuner``) is a pure object: each control interval it is
given what the coordinator would measure (a ``Sample``) and returns the worker count for the
next. Here a throughput curve stands in for the pipeline, so a 96-CPU node runs in
milliseconds on CI's 2 cores. Each curve asserts that the count in force reaches >= 95 % of
the best count's throughput within a stated number of control intervals (of 0.25 s, the
default ``AutoWorkers.interval``), and stays there on average for the rest of the run.

``python tests/test_autotune_curves.py`` prints the table the docs show
(docs/guide/autotuning.md).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from procpipe._core.nodeshare import NodeShare
from procpipe._engine.autotune import AutoWorkers
from procpipe._engine.policy import Sample, Tuner

INTERVAL = 0.25  # seconds per control interval (AutoWorkers' default)
PER_WORKER = 100.0  # batches/s one worker delivers on a CPU of its own
MAIN_CPU = 0.2  # the training process's own CPU use (the coordinator, a light training loop)


@dataclass
class Curve:
    """A pipeline: ``rate(n, t)`` (batches/s, without noise) and what the coordinator measures."""

    name: str
    cpus: int
    rate: Callable[[int, int], float]  # (workers, interval index) -> batches/s
    measure: Callable[[int, int, float], Sample]  # (workers, interval, measured rate) -> Sample
    intervals: int  # the run's length
    within: int  # must reach 95 % within this many intervals (after ``since``)
    since: int = 0  # when the best count changes (the training step takes CPUs)
    max: int | None = None
    noise: float = 0.0  # +- this fraction, uniform, per interval

    def best(self, t: int) -> float:
        return max(self.rate(n, t) for n in range(1, 4 * self.cpus + 1))


def cpu_bound(cpus: int, main: Callable[[int], float] = lambda t: MAIN_CPU,
              free: Callable[[int], int] | None = None) -> tuple[Callable, Callable]:
    """CPU-bound workers: linear up to the CPUs the training process leaves them (``free``);
    beyond, they queue for a CPU, and also slow the training process down (it shares its CPUs)."""
    free = free or (lambda t: cpus)

    def rate(n: int, t: int) -> float:
        avail = free(t)
        slow = min(1.0, math.sqrt(cpus / (n + cpus - avail))) if n > avail else 1.0
        return PER_WORKER * min(n, avail) * slow

    def measure(n: int, t: int, r: float) -> Sample:
        on_cpu = min(float(n), float(free(t)))
        return Sample(INTERVAL, r, wait=0.4, busy=float(n), cpu=on_cpu, runq=n - on_cpu, main_cpu=main(t))

    return rate, measure


def saturating(cpus: int, at: int) -> tuple[Callable, Callable]:
    """Throughput stops growing at ``at`` workers (a shared disk or memory bandwidth): the workers
    stay busy, but beyond ``at`` they wait on the shared resource (off-CPU)."""
    def rate(n: int, t: int) -> float:
        return PER_WORKER * min(n, at)

    def measure(n: int, t: int, r: float) -> Sample:
        cpu = min(float(n), float(cpus)) * min(1.0, at / n)
        return Sample(INTERVAL, r, wait=0.4, busy=float(n), cpu=cpu, main_cpu=MAIN_CPU)

    return rate, measure


def io_bound(linear_to: int) -> tuple[Callable, Callable]:
    """Workers that sleep on I/O (10 % of their busy time on a CPU): linear past the CPUs, to ``linear_to``."""
    def rate(n: int, t: int) -> float:
        return PER_WORKER * min(n, linear_to)

    def measure(n: int, t: int, r: float) -> Sample:
        return Sample(INTERVAL, r, wait=0.4, busy=float(n), cpu=0.1 * n, main_cpu=MAIN_CPU)

    return rate, measure


HALF = 120  # the training step starts taking 4 CPUs at interval 120 (30 s)


def curves() -> list[Curve]:
    out = []
    for cpus, within in ((16, 8), (64, 12), (96, 14)):
        rate, measure = cpu_bound(cpus)
        out.append(Curve(f"linear to {cpus} (CPU-bound, {cpus} CPUs)", cpus, rate, measure, 120, within))
    rate, measure = saturating(16, 10)
    out.append(Curve("saturating at 10 (16 CPUs)", 16, rate, measure, 120, 8))
    for cpus, within in ((16, 12), (64, 20)):
        rate, measure = cpu_bound(cpus)
        out.append(Curve(f"linear to {cpus}, noisy +-15 % (seeds 0-9)", cpus, rate, measure, 120, within, noise=0.15))
    rate, measure = cpu_bound(96)
    out.append(Curve("linear to 96, noisy +-15 % (seeds 0-9)", 96, rate, measure, 160, 24, noise=0.15))
    rate, measure = saturating(16, 10)
    out.append(Curve("saturating at 10, noisy +-15 % (seeds 0-9)", 16, rate, measure, 120, 16, noise=0.15))
    rate, measure = io_bound(24)
    out.append(Curve("I/O-bound, linear to 24 (4 CPUs)", 4, rate, measure, 120, 12, max=32))
    out.append(Curve("I/O-bound, linear to 24, noisy +-15 % (seeds 0-9)", 4, rate, measure, 120, 16, max=32,
                     noise=0.15))
    rate, measure = cpu_bound(16, main=lambda t: MAIN_CPU if t < HALF else MAIN_CPU + 4,
                              free=lambda t: 16 if t < HALF else 12)
    out.append(Curve("training step takes 4 of 16 CPUs at 30 s", 16, rate, measure, 2 * HALF, 8, since=HALF))
    return out


def run(curve: Curve, seed: int = 0) -> tuple[list[int], list[float]]:
    """Drive a tuner through ``curve``: the counts in force, and the fraction of the best throughput each gave."""
    rng = np.random.default_rng(seed)
    auto = AutoWorkers(max=curve.max)
    hard_max = curve.max or min(128, 4 * curve.cpus)
    tuner = Tuner(auto.min, hard_max, capacity=hard_max, workers=2, started=0.0, cpus=curve.cpus)
    counts, fractions, n = [], [], 2
    for t in range(curve.intervals):
        true = curve.rate(n, t)
        measured = true * (1.0 + curve.noise * rng.uniform(-1, 1)) if curve.noise else true
        counts.append(n)
        fractions.append(true / curve.best(t))
        n = tuner.step((t + 1) * INTERVAL, curve.measure(n, t, measured))
        assert 1 <= n <= hard_max
    return counts, fractions


def reached(fractions: list[float], since: int = 0) -> int | None:
    """Intervals after ``since`` until the count in force gives >= 95 % of the best and the rest of
    the run does too, on average (a trial that costs now and then is allowed); None: never."""
    for i in range(since, len(fractions)):
        if fractions[i] >= 0.95 and np.mean(fractions[i:]) >= 0.95:
            return i - since
    return None


@pytest.mark.unit  # starts no process (tests/conftest.py)
@pytest.mark.parametrize("curve", curves(), ids=lambda c: c.name)
def test_each_curve_reaches_95_percent_of_the_best_count_quickly(curve):
    seeds = range(10) if curve.noise else range(1)
    for seed in seeds:
        counts, fractions = run(curve, seed)
        got = reached(fractions, curve.since)
        assert got is not None and got <= curve.within, (
            f"{curve.name}, seed {seed}: reached 95 % after {got} intervals (> {curve.within} = "
            f"{curve.within * INTERVAL:g} s); counts {counts[curve.since:curve.since + 40]}")


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_growth_takes_steps_that_grow_not_one_worker_at_a_time():
    rate, measure = cpu_bound(96)
    counts, _ = run(Curve("96", 96, rate, measure, 40, 0))
    distinct = list(dict.fromkeys(counts))
    assert distinct[:7] == [2, 4, 8, 16, 32, 64, 96], distinct


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_cpu_bound_work_stops_at_the_cpu_budget():
    rate, measure = cpu_bound(16)
    counts, _ = run(Curve("16", 16, rate, measure, 200, 0))
    assert max(counts) <= 17 and counts[-1] == 16, counts  # (one probe past it, when the CPUs are contended)


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_it_backs_off_when_the_training_step_takes_cpus_and_grows_back_when_it_gives_them_back():
    busy = lambda t: HALF <= t < 2 * HALF  # noqa: E731
    rate, measure = cpu_bound(16, main=lambda t: MAIN_CPU + (4 if busy(t) else 0), free=lambda t: 12 if busy(t) else 16)
    curve = Curve("back", 16, rate, measure, 3 * HALF, 0)
    counts, fractions = run(curve)
    assert counts[HALF - 1] == 16 and 12 <= counts[2 * HALF - 1] <= 13, counts[HALF - 5: 2 * HALF]
    assert reached(fractions, 2 * HALF) is not None and reached(fractions, 2 * HALF) <= 8
    assert counts[-1] == 16


# --------------------------------------------------------------------------- several ranks, one node
NODE_CPUS = 16
STAGGER = 3  # intervals between two ranks' starts


def node_rates(counts: list[int]) -> list[float]:
    """Each rank's throughput on a 16-CPU node of CPU-bound workers: linear while the workers fit;
    oversubscribed, the CPUs are time-shared and switching costs (~12 % at 60 workers, as measured
    with 4 ranks x 15 workers on 16 cores)."""
    total = sum(counts)
    share = min(1.0, NODE_CPUS / total) * (min(1.0, NODE_CPUS / total) ** 0.1)
    return [PER_WORKER * n * share for n in counts]


def run_ranks(ranks: int, directory: str | None, intervals: int = 80) -> tuple[list[list[int]], list[float]]:
    """``ranks`` tuners on one node, sharing its CPUs through a node file in ``directory``
    (None: each on its own, taking the whole node as its budget)."""
    t0 = time.time()
    tuners = [Tuner(1, 64, 64, workers=2, started=0.0, cpus=NODE_CPUS) for _ in range(ranks)]
    shares = [NodeShare(directory, NODE_CPUS, key=f"rank{r}") if directory else None for r in range(ranks)]
    counts = [[2] * ranks]
    totals = []
    try:
        for t in range(intervals):
            now = (t + 1) * INTERVAL
            ns = counts[-1]
            rates = node_rates(ns)
            totals.append(sum(rates))
            nxt = []
            for r, tuner in enumerate(tuners):
                if t < STAGGER * r:  # ranks start one after the other, as real ones do
                    nxt.append(ns[r])
                    continue
                on_cpu = ns[r] * min(1.0, NODE_CPUS / sum(ns))
                sample = Sample(INTERVAL, rates[r], wait=0.4, busy=float(ns[r]), cpu=on_cpu, runq=ns[r] - on_cpu,
                                main_cpu=MAIN_CPU)
                node = shares[r]
                if node is not None:
                    tuner.cpus = node.update(tuner.want_cpus(), now=t0 + now)
                    tuner.shared = node.peers > 1
                nxt.append(tuner.step(now, sample))
            counts.append(nxt)
    finally:
        for node in shares:
            if node is not None:
                node.leave()
    return counts, totals


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_ranks_sharing_a_node_come_close_to_the_best_fixed_split(tmp_path, ranks):
    best = sum(node_rates([NODE_CPUS // ranks] * ranks))  # the best fixed split: 16 / ranks each
    counts, totals = run_ranks(ranks, str(tmp_path))
    late = totals[20:]  # after 5 s
    assert np.mean(late) >= 0.95 * best, (np.mean(late) / best, counts[-1])
    assert min(counts[-1]) >= 0.75 * NODE_CPUS / ranks, counts[-1]  # none starved
    assert sum(counts[-1]) <= NODE_CPUS, counts[-1]  # not oversubscribed
    assert os.listdir(tmp_path) == []  # the last one out removed the node file


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_without_sharing_ranks_oversubscribe_the_node(tmp_path):
    """What the node file prevents: each rank alone grows to the whole node."""
    counts, totals = run_ranks(4, None)
    assert sum(counts[-1]) >= 3 * NODE_CPUS


def table() -> list[tuple[str, str, str]]:
    rows = []
    for curve in curves():
        seeds = range(10) if curve.noise else range(1)
        got = [reached(run(curve, s)[1], curve.since) for s in seeds]
        worst = None if None in got else max(g for g in got if g is not None)
        final = run(curve)[0][-1]
        rows.append((curve.name, f"{worst} ({worst * INTERVAL:g} s)" if worst is not None else "never",
                     f"{curve.within} ({curve.within * INTERVAL:g} s)", str(final)))
    for ranks in (2, 4, 8):
        best = sum(node_rates([NODE_CPUS // ranks] * ranks))
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            counts, totals = run_ranks(ranks, d)
        first = reached([x / best for x in totals])
        rows.append((f"{ranks} ranks x auto on 16 CPUs (node file): {np.mean(totals[20:]) / best:.2f} of "
                     f"{ranks} x fixed {NODE_CPUS // ranks}", f"{first} ({(first or 0) * INTERVAL:g} s)", "20 (5 s)",
                     "+".join(map(str, counts[-1]))))
    counts, totals = run_ranks(4, None)
    rows.append((f"4 ranks x auto, no node file: {np.mean(totals[20:]) / sum(node_rates([4] * 4)):.2f} of 4 x fixed 4",
                 "-", "-", "+".join(map(str, counts[-1]))))
    return rows


if __name__ == "__main__":  # the docs' table
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print("| curve | intervals to 95 % (worst seed) | asserted within | final workers |")
    print("|---|---|---|---|")
    for row in table():
        print("| " + " | ".join(row) + " |")
