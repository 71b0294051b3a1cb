"""The global generators (``random``, ``np.random``) around the user's code, on every path.

A ``BaseException`` from ``fn`` with ``workers=0`` still puts the caller's generators back;
``collate_fn`` and ``batch_fn`` see the same global draws whatever the worker count; the
cache's first sample is seeded like a worker's and leaves the caller's state alone;
streaming batches of torch tensors span blocks.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from procpipe import Loader, Shards


class Interrupt(BaseException):
    """A BaseException subclass that is not an Exception (as a framework's own may be)."""


def _interrupt_at_5(i):
    if i == 5:
        raise Interrupt("stop here")
    return np.array([np.random.randint(1 << 30), random.getrandbits(30)], np.int64)


def _callers_next_draws(seed: int) -> tuple:
    np.random.seed(seed)
    random.seed(seed)
    return np.random.randint(1 << 30), random.getrandbits(30)


def _open_ints(shard):
    for i in range(shard[1]):
        yield shard[0] * 100 + i


@pytest.mark.parametrize("stream", [False, True], ids=["indexed", "streaming"])
def test_a_base_exception_with_workers_0_puts_the_callers_generators_back_and_is_named(stream):
    expected = _callers_next_draws(3)
    np.random.seed(3)
    random.seed(3)
    source = Shards([(0, 8)], _open_ints, block_length=4) if stream else list(range(8))
    fn = (lambda r: _interrupt_at_5(r % 100)) if stream else _interrupt_at_5
    with Loader(source, fn, batch_size=4, workers=0) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(Interrupt) as info:
            next(it)
        assert (np.random.randint(1 << 30), random.getrandbits(30)) == expected, "the caller's state was not put back"
        assert any("workers=0" in note for note in getattr(info.value, "__notes__", [])), "no note says where"
        if not stream:
            assert any("index 5" in note for note in info.value.__notes__)


def _draw_collate(samples):
    return np.array([[s, np.random.randint(1 << 30), int(random.random() * (1 << 30))] for s in samples], np.int64)


def _draw_batch_fn(batch):
    return batch + np.random.randint(1 << 20)


@pytest.mark.parametrize("stage", ["collate_fn", "batch_fn"])
def test_draws_in_collate_fn_and_batch_fn_are_the_same_for_any_worker_count(stage):
    kwargs = {"collate_fn": _draw_collate} if stage == "collate_fn" else {"batch_fn": _draw_batch_fn}

    def run(workers):
        with Loader(list(range(12)), batch_size=4, workers=workers, seed=2, **kwargs) as loader:
            return [np.asarray(b).copy() for b in loader]

    zero = run(0)
    assert len({b.tobytes() for b in zero}) == len(zero)
    for workers in (1, 2):
        other = run(workers)
        for a, b in zip(zero, other, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"workers={workers} draws differ from workers=0")
    np.testing.assert_array_equal(np.concatenate(zero), np.concatenate(run(0)), err_msg="not reproducible")


def test_streaming_collate_fn_draws_are_the_same_for_any_worker_count():
    def run(workers):
        with Loader(Shards([(0, 8), (1, 8)], _open_ints, block_length=4), batch_size=4, workers=workers, seed=2,
                    collate_fn=_draw_collate) as loader:
            return sorted(np.asarray(b).tobytes() for b in loader)

    assert run(0) == run(1) == run(2)


def _random_fn(i):
    return np.float64(np.random.random())


def test_the_caches_first_sample_is_seeded_and_leaves_the_callers_generators_alone():
    expected = _callers_next_draws(11)
    np.random.seed(11)
    random.seed(11)
    with Loader(list(range(4)), _random_fn, batch_size=None, workers=0, cache=True) as loader:
        assert (np.random.randint(1 << 30), random.getrandbits(30)) == expected, "creating the cache drew"
        cached = [float(x) for x in loader]
    np.random.seed(99)  # the caller's state does not matter: the first sample is seeded like a worker's
    with Loader(list(range(4)), _random_fn, batch_size=None, workers=1, cache=True) as loader:
        assert [float(x) for x in loader] == cached


def test_streaming_torch_tensor_batches_span_blocks():
    torch = pytest.importorskip("torch")

    def open_tensors(shard):
        for i in range(shard[1]):
            yield torch.tensor([shard[0] * 100 + i, i], dtype=torch.int32)

    expected = None
    for workers in (0, 1):
        with Loader(Shards([(0, 6), (1, 6)], open_tensors, block_length=3, cycle_length=1), batch_size=4,
                    workers=workers) as loader:
            batches = [b.clone() for b in loader]
        assert all(isinstance(b, torch.Tensor) and b.dtype == torch.int32 for b in batches)
        got = torch.cat(batches)[:, 0].tolist()
        assert sorted(got) == [s * 100 + i for s in (0, 1) for i in range(6)]
        if expected is not None:
            assert got == expected
        expected = got


@pytest.mark.parametrize("seed", [0, 1, 2**32 + 5, 2**64 - 1])
def test_the_per_sample_seeding_is_random_seed_and_np_random_seed(seed):
    """seed_global_generators calls the seeding below random.seed directly (speed): same states,
    the gauss cache included; a SampleScope's seed is mix_seed(seed, epoch, index)."""
    from procpipe._core.rng import SampleScope, mix_seed, seed_global_generators

    random.gauss(0, 1)  # leaves a cached gaussian, which seeding must clear
    np.random.normal()
    seed_global_generators(seed)
    got = (random.getstate(), random.gauss(0, 1), np.random.normal(), np.random.randint(1 << 30))
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    assert got == (random.getstate(), random.gauss(0, 1), np.random.normal(), np.random.randint(1 << 30))
    scope = SampleScope(seed, seed_globals="sample")
    for epoch, index in [(0, 3), (0, 4), (2, 3), (2, (1, 7))]:
        scope.enter(epoch, index)
        got = random.getrandbits(64)
        random.seed(mix_seed(seed, epoch, *(index if isinstance(index, tuple) else (index,))))
        assert got == random.getrandbits(64)
    scope.leave()
