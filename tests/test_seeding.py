"""The global generators' seeding modes (``seed_globals``: ``"task"`` by default, ``"sample"``, off).

Whatever the mode, what ``fn`` draws from ``random`` / ``np.random`` depends only on
``(seed, epoch, the batch)``: the same with 0, 1 or 2 workers, after a worker crashed
mid-batch, and when a straggler's batch was run twice (speculation).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
from faultkit import BS, N, Faulty

from procpipe import Loader
from procpipe._core.rng import _TASK_MARK, SampleScope, mix_seed


class GlobalDraws(Faulty):
    """``Faulty`` (crashes, sleeps on chosen indices) whose values are draws from the global generators."""

    def __call__(self, i):
        index, _ = super().__call__(i)
        return index, np.array([i, np.random.randint(1 << 30), random.getrandbits(30)], np.int64)


def _epoch(mode, workers, fn=None, **kwargs):
    with Loader(list(range(N)), fn or GlobalDraws(), batch_size=BS, workers=workers, shuffle=True, seed=5,
                seed_globals=mode, **kwargs) as loader:
        return {int(i): v.tolist() for idx, vals in loader for i, v in zip(idx, vals, strict=True)}


@pytest.mark.parametrize("mode", [True, "sample"])
def test_global_draws_are_the_same_for_any_worker_count_crash_and_speculation(mode, tmp_path):
    (tmp_path / "crash").mkdir()
    (tmp_path / "slow").mkdir()
    reference = _epoch(mode, 0)
    assert len({tuple(v[1:]) for v in reference.values()}) == N, "two samples drew the same values"
    other = _epoch("sample" if mode is True else True, 0)
    assert all(other[i] != reference[i] for i in range(N)), "the two modes gave the same draws"
    assert _epoch(mode, 1) == reference
    if mode == "sample":
        return  # per sample: the order of the draws cannot matter; the crash and straggler cases are for "task"
    assert _epoch(mode, 2, GlobalDraws(tmp_path / "crash", {5: "sigkill", 30: "exit"})) == reference
    straggler = GlobalDraws(tmp_path / "slow", {22: ("sleep", 1.0)}, delay=0.002)
    assert _epoch(mode, 2, straggler, speculate=2.0, prefetch=1) == reference


def test_task_mode_seeds_once_per_task_from_its_first_index():
    scope = SampleScope(9, seed_globals=True)
    draws = []
    for index in (12, 13, 14):
        scope.enter(3, index)
        draws.append(random.getrandbits(64))
    scope.leave()
    random.seed(mix_seed(9, 3, _TASK_MARK, 12))
    assert draws == [random.getrandbits(64) for _ in range(3)]
    scope.enter(3, 16)  # a new task: seeded again
    first = random.getrandbits(64)
    scope.leave()
    random.seed(mix_seed(9, 3, _TASK_MARK, 16))
    assert first == random.getrandbits(64)


def _draw_in_fn(x):
    return np.float64(np.random.random())


def _draw_in_augment(sample):
    return np.array([sample, np.random.random()])


def test_cached_or_not_the_draws_after_the_cache_are_the_same():
    """A cached stage runs under its sample's own seed (epoch 0's, whichever epoch fills the
    cache): what is cached, and augment's draws after it, do not depend on whether this attempt
    computed the sample or found it cached."""
    def epoch_1(loader):
        loader.set_epoch(1)
        return np.concatenate([np.asarray(b) for b in loader])

    with Loader(list(range(12)), _draw_in_fn, batch_size=4, workers=0, cache=True, augment=_draw_in_augment) as warm:
        list(warm)  # epoch 0 fills the cache
        hits = epoch_1(warm)
    with Loader(list(range(12)), _draw_in_fn, batch_size=4, workers=0, cache=True, augment=_draw_in_augment) as cold:
        misses = epoch_1(cold)  # computed now
    np.testing.assert_array_equal(hits, misses)


def test_seed_globals_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match=r"seed_globals must be True .*'sample'.*False"):
        Loader(list(range(4)), batch_size=2, workers=0, seed_globals="per-sample")


@pytest.mark.parametrize("mode", ["task", "sample", False])
def test_a_tasks_samples_entered_through_each_draw_as_when_entered_one_by_one(mode):
    """SampleScope.each (an indexed task's loop) names a later sample without re-entering it:
    every sample's sample_rng() and the global generators' draws are those of enter()."""
    from procpipe._core.rng import sample_rng

    def draws(one_by_one: bool) -> list:
        random.seed(0)  # (seed_globals=False leaves them alone: the same start for both)
        np.random.seed(0)
        scope = SampleScope(7, seed_globals=mode)
        got = []
        for task in ([3, 4, 5], [9, 1]):
            indices = iter(task) if one_by_one else scope.each(2, task)
            for index in indices:
                if one_by_one:
                    scope.enter(2, index)
                got.append((scope.index, int(sample_rng().integers(1 << 30)), random.random(), np.random.rand()))
            scope.leave()
        return got

    assert draws(one_by_one=False) == draws(one_by_one=True)
