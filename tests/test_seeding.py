"""The global generators' seeding modes (``seed_globals``: ``"task"`` by default, ``"sample"``, off).

Whatever the mode, what ``fn`` draws from ``random`` / ``np.random`` depends only on
``(seed, epoch, the batch)``: the same with 0, 1 or 2 workers, after a worker crashed
mid-batch, and when a straggler's batch was run twice (speculation).
"""
from __future__ import annotations

import random
import textwrap

import numpy as np
import pytest
from conftest import run_python
from faultkit import BS, Faulty, N

import procpipe
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


def test_sample_rng_outside_a_loader_raises():
    with pytest.raises(RuntimeError, match="outside a procpipe.Loader"):
        procpipe.sample_rng()


class DrawingDataset:
    """``__getitem__`` draws from the global generators, as torchvision-style transforms do."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([np.random.randint(1 << 30), random.getrandbits(30)], dtype=np.int64)


def _draws(workers: int, seed: int = 0, **kw) -> np.ndarray:
    with procpipe.Loader(DrawingDataset(), batch_size=3, workers=workers, seed=seed, **kw) as loader:
        return np.concatenate([b.copy() for b in loader])


def test_global_generators_are_seeded_per_sample():
    two = _draws(2)
    assert len({tuple(row) for row in two}) == len(two), "two samples got the same draws"
    np.testing.assert_array_equal(two, _draws(2), err_msg="not reproducible across runs")
    np.testing.assert_array_equal(two, _draws(1), err_msg="depends on the worker count")
    np.testing.assert_array_equal(two, _draws(0), err_msg="workers=0 differs")
    np.testing.assert_array_equal(two, _draws(2, start_method="forkserver"), err_msg="forkserver differs")
    assert not np.array_equal(two, _draws(2, seed=1)), "the seed does not matter"


def test_workers_0_leaves_the_callers_generators_alone():
    np.random.seed(5)
    random.seed(5)
    expected = (np.random.randint(1 << 30), random.getrandbits(30))
    np.random.seed(5)
    random.seed(5)
    _draws(0)
    assert (np.random.randint(1 << 30), random.getrandbits(30)) == expected


def test_seed_globals_false_leaves_them_alone():
    # With workers=0 and no seeding, the draws continue the caller's stream.
    np.random.seed(7)
    random.seed(7)
    out = _draws(0, seed_globals=False)
    np.random.seed(7)
    random.seed(7)
    expected = [(np.random.randint(1 << 30), random.getrandbits(30)) for _ in range(12)]
    assert [tuple(r) for r in out] == expected


TORCH_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import procpipe

    class Draw:
        def __len__(self):
            return 8
        def __getitem__(self, i):
            return torch.randint(0, 1 << 30, (1,)).numpy()

    def run(workers):
        with procpipe.Loader(Draw(), batch_size=2, workers=workers, seed=3) as loader:
            return [int(x) for b in loader for x in b.ravel()]

    two, one = run(2), run(1)
    assert len(set(two)) == len(two), two
    assert two == one, (two, one)
    print(",".join(map(str, two)))
""")


def test_torch_generator_is_seeded_per_sample(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "draw_torch.py"
    script.write_text(TORCH_SCRIPT)
    runs = [run_python([str(script)], timeout=240) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert runs[0].stdout == runs[1].stdout, "torch draws differ between runs"
