"""``procpipe.Mix``: weighted mixtures of sources (tf.data's ``sample_from_datasets``).

Proportions (a chi-square statistic computed here, with a fixed seed: deterministic), the
same stream whatever the worker count, exactly once with ``stop_on_empty=False``, where
``stop_on_empty=True`` ends, weight schedules and their record in ``state_dict`` (a resumed
epoch keeps the weights it began with, later epochs take the loader's), sharding, nested
mixtures, hundreds of sources at a cost per element not per source, and the errors.
(Resume mid-epoch for every worker count / order / epochs: tests/test_resume_matrix.py, kind "mix".)
"""
from __future__ import annotations

import json
import tracemalloc
from collections import Counter

import numpy as np
import pytest

from procpipe import Loader, Mix, Shards

A = np.arange(0, 600)  # source k holds k * 1000 + i: the source of an element is element // 1000
B = np.arange(1000, 1300)
C = np.arange(2000, 2100)


def flat(loader):
    return [int(x) for batch in loader for x in np.asarray(batch).reshape(-1)]


def chi_square(counts, probabilities):
    counts = np.asarray(counts, dtype=float)
    expected = counts.sum() * np.asarray(probabilities, dtype=float)
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_DF2_P001 = 13.816  # the chi-square distribution's 99.9 % quantile, 2 degrees of freedom


def test_proportions_follow_the_weights():
    """With stop_on_empty=True every draw uses the weights as given: the sources' counts are a
    multinomial sample. Checked with a chi-square statistic (fixed seed, so deterministic) over
    4 epochs, and against a wrong hypothesis (equal weights), which the same test rejects."""
    weights = [0.6, 0.3, 0.1]
    sources = [np.arange(k * 100_000, k * 100_000 + n) for k, n in enumerate((20_000, 20_000, 1_500))]
    mix = Mix(sources, weights, stop_on_empty=True)
    with Loader(mix, batch_size=1000, workers=0, seed=7, epochs=4, with_epoch=True, seed_globals=False) as loader:
        counts: dict[int, Counter] = {}
        for epoch, batch in loader:
            counts.setdefault(epoch, Counter()).update((np.asarray(batch) // 100_000).tolist())
    assert sorted(counts) == [0, 1, 2, 3]
    for epoch, c in counts.items():
        observed = [c[0], c[1], c[2]]
        # the epoch ends at the first draw of the source that ran out: the rare one (1 500 elements)
        assert observed[2] == 1_500 and observed[0] < 20_000, observed
        assert chi_square(observed, weights) < CHI2_DF2_P001, (epoch, observed)
        assert chi_square(observed, [1 / 3] * 3) > 1000, (epoch, observed)
    # epochs draw differently
    assert len({tuple(sorted(c.items())) for c in counts.values()}) == 4


def test_proportions_before_a_source_runs_out_and_exactly_once():
    """stop_on_empty=False: until the first source runs out the draws follow the weights; the
    epoch still holds every element of every source exactly once."""
    weights = [5, 3, 2]  # any scale
    with Loader(Mix([A, B, C], weights), batch_size=50, workers=0, shuffle=True, seed=3) as loader:
        got = flat(loader)
        assert len(loader) == 20
    assert sorted(got) == sorted([*A.tolist(), *B.tolist(), *C.tolist()])
    head = Counter(x // 1000 for x in got[:400])  # C (100 at 20 %) runs out near element 500
    assert chi_square([head[0], head[1], head[2]], [0.5, 0.3, 0.2]) < CHI2_DF2_P001, head
    # each source is read in its own shuffled order, not 0, 1, 2...
    assert [x for x in got if x < 1000] != sorted(x for x in got if x < 1000)


def test_same_stream_whatever_the_worker_count():
    def make(workers):
        nested = Mix([B, C], [1, 1])
        return Loader(Mix([A, nested], [2, 1]), batch_size=16, workers=workers, shuffle=True, seed=5, epochs=2)

    runs = {}
    for workers in (0, 1, 2):
        with make(workers) as loader:
            runs[workers] = flat(loader)
    assert runs[0] == runs[1] == runs[2]
    per_epoch = len(A) + len(B) + len(C)
    assert len(runs[0]) == 2 * per_epoch
    first, second = runs[0][:per_epoch], runs[0][per_epoch:]
    assert sorted(first) == sorted(second) and first != second  # every element once per epoch, new order


def test_stop_on_empty_ends_at_the_first_draw_of_an_empty_source():
    mix = Mix([np.arange(0, 5), np.arange(1000, 2000)], [1, 1], stop_on_empty=True)
    with Loader(mix, batch_size=None, workers=0, seed=1, epochs=3, with_epoch=True) as loader:
        epochs: dict[int, list[int]] = {}
        for epoch, x in loader:
            epochs.setdefault(epoch, []).append(int(x))
    for got in epochs.values():
        small = [x for x in got if x < 5]
        assert small == [0, 1, 2, 3, 4]  # all of the small source (in order: shuffle=False)
        assert len(got) < 40  # the large one only until the small one ran out (about 5 draws each)
    assert len({tuple(got) for got in epochs.values()}) == 3  # each epoch draws anew


def test_with_source_tags_each_element_with_its_source():
    mix = Mix([["a", "b"], [], ["c"]], [1, 1, 1], with_source=True)  # an empty source is allowed
    assert len(mix) == 3 and mix[0] == (0, "a") and mix[2] == (2, "c") and mix[-1] == (2, "c")
    assert mix.source_of(1) == (0, 1)
    with Loader(mix, batch_size=None, workers=0) as loader:
        assert sorted(loader) == [(0, "a"), (0, "b"), (2, "c")]
    with pytest.raises(IndexError, match="out of range"):
        mix[3]


def test_weights_schedule_callable_and_zero_weights():
    """A callable schedule: epoch 0 draws only from A, epoch 1 only from B (weight 0: left out)."""
    mix = Mix([A[:10], B[:10]], lambda epoch: [1, 0] if epoch % 2 == 0 else [0, 1])
    with Loader(mix, batch_size=5, workers=2, epochs=3, with_epoch=True) as loader:
        got: dict[int, list[int]] = {}
        for epoch, batch in loader:
            got.setdefault(epoch, []).extend(np.asarray(batch).tolist())
    assert got == {0: list(range(10)), 1: list(range(1000, 1010)), 2: list(range(10))}


def test_set_weights_between_iterations():
    mix = Mix([A[:10], B[:10]], [1, 0])
    with Loader(mix, batch_size=5, workers=0) as loader:
        assert flat(loader) == list(range(10))
        mix.set_weights([0, 1])
        assert flat(loader) == list(range(1000, 1010))
        with pytest.raises(ValueError, match="2 sources"):
            mix.set_weights([1, 2, 3])


def test_resume_keeps_the_weights_of_the_epoch_begun_and_takes_the_new_ones_after():
    """A state records the weights in force (mix_weights); a loader whose mixture has other
    weights resumes the interrupted epoch exactly as it was, then uses its own."""
    def make(weights):
        return Loader(Mix([A[:40], B[:40], C[:40]], weights), batch_size=6, workers=2, shuffle=True, seed=9,
                      epochs=2, with_epoch=True, ordered=False)

    def run(loader):
        return [(e, int(x)) for e, batch in loader for x in np.asarray(batch).tolist()]

    with make([1, 1, 1]) as loader:
        full = run(loader)
    with make([1, 1, 1]) as first:
        it = iter(first)
        taken = [(e, int(x)) for e, batch in (next(it) for _ in range(5)) for x in np.asarray(batch).tolist()]
        state = json.loads(json.dumps(first.state_dict()))
    assert state["mix_weights"][0] == [0, [[1.0, 1.0, 1.0]]]
    with make([0, 0, 1]) as second:  # new weights: the rest of epoch 0 as before, epoch 1 only C
        second.load_state_dict(state)
        rest = run(second)
    epoch0 = sorted(x for e, x in taken + rest if e == 0)
    assert epoch0 == sorted(x for e, x in full if e == 0)
    assert sorted(x for e, x in rest if e == 1) == list(range(2000, 2040))
    # the state of the resumed loader names the pinned weights again
    with make([0, 0, 1]) as third:
        third.load_state_dict(state)
        assert third.state_dict()["mix_weights"] == [[0, [[1.0, 1.0, 1.0]]]]


def test_resume_checks_the_mixture():
    def make(sources, stop_on_empty=False):
        return Loader(Mix(sources, [1] * len(sources), stop_on_empty=stop_on_empty), batch_size=4, workers=0)

    with make([A[:10], B[:10]]) as loader:
        state = loader.state_dict()
    with make([A[:12], B[:8]]) as other, pytest.raises(ValueError, match="mix="):
        other.load_state_dict(state)  # same total length, other sources
    with make([A[:10], B[:10]], stop_on_empty=True) as other, pytest.raises(ValueError, match="mix="):
        other.load_state_dict(state)
    with Loader(np.arange(20), batch_size=4, workers=0) as plain, pytest.raises(ValueError, match="mix="):
        plain.load_state_dict(state)
    with make([A[:10], B[:10]]) as same:
        for corrupt in ([[0, [[1.0, -1.0]]]], [[0, [[1.0]]]], [[1, [[1.0, 1.0]]]], "x"):
            with pytest.raises(ValueError, match="mix_weights"):
                same.load_state_dict({**state, "mix_weights": corrupt})


def test_shards_split_each_epoch_of_a_mixture():
    def run(rank):
        mix = Mix([A[:21], B[:10]], [2, 1])
        with Loader(mix, batch_size=4, workers=0, shuffle=True, seed=2, shard=(rank, 2)) as loader:
            return flat(loader)

    ranks = [run(0), run(1)]
    assert len(ranks[0]) == len(ranks[1]) == 16  # 31 elements, padded to 32 by repeating the first
    counts = Counter(ranks[0] + ranks[1])
    assert sorted(counts) == sorted([*A[:21].tolist(), *B[:10].tolist()])
    assert sorted(counts.values()) == [1] * 30 + [2]


def test_reshuffle_false_keeps_one_order():
    mix = Mix([A[:20], B[:20]], [1, 1])
    with Loader(mix, batch_size=8, workers=0, shuffle=True, seed=4, reshuffle=False, epochs=2) as loader:
        got = flat(loader)
    assert got[:40] == got[40:]


def test_hundreds_of_sources_cost_per_element_not_per_source():
    """300 small sources: every element once through a Loader, a small state, and planning an
    epoch (``Mix.order``, what the loader's sampler calls) keeps nothing afterwards, with a peak
    of a few arrays of the epoch's length plus a few numbers per source (tracemalloc: memory, not time)."""
    sources = [list(range(k * 1000, k * 1000 + 7)) for k in range(300)]
    weights = list(range(1, 301))
    mix = Mix(sources, weights)
    with Loader(mix, batch_size=64, workers=2, shuffle=True, seed=8) as loader:
        got = flat(loader)
        state = loader.state_dict()
    assert sorted(got) == sorted(x for s in sources for x in s)
    assert len(json.dumps(state)) < 20_000  # lengths and weights: a few numbers per source
    elements = len(mix)  # 2100
    mix.order(8, 0, True, [weights])  # warm (numpy's first calls allocate caches of their own)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    orders = [mix.order(8, epoch, True, [weights]) for epoch in range(1, 4)]
    del orders
    kept = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert kept < 20_000, kept
    assert peak < 8 * 8 * elements + 300 * 200, peak  # ~8 arrays of the epoch + ~200 bytes per source


def test_mix_arguments_are_checked():
    with pytest.raises(ValueError, match="3 entries for 2 sources"):
        Mix([A, B], [1, 2, 3])
    with pytest.raises(ValueError, match=r"weights\[1\] = -1"):
        Mix([A, B], [1, -1])
    with pytest.raises(ValueError, match="all 0"):
        Mix([A, B], [0, 0])
    with pytest.raises(ValueError, match="finite"):
        Mix([A, B], [1, float("nan")])
    with pytest.raises(TypeError, match="sources\\[1\\]"):
        Mix([A, iter([1, 2])], [1, 1])
    with pytest.raises(ValueError, match=r"no Shards\(lengths=...\): pass Mix\(..., shard_size=N\)"):
        Mix([A, Shards([1], lambda shard: [shard])], [1, 1])  # (beside streams: tests/test_mix_kinds.py)
    with pytest.raises(ValueError, match="empty"):
        Mix([], [])
    with pytest.raises(TypeError, match="stop_on_empty"):
        Mix([A], [1], stop_on_empty="yes")
    schedule = Mix([A, B], lambda epoch: [1, 2, 3])
    with pytest.raises(ValueError, match="epoch 0"):
        Loader(schedule, batch_size=4, workers=0).state_dict()
    with pytest.raises(ValueError, match="Mix draws each epoch"):
        Loader(Mix([A, B], [1, 1]), batches=lambda epoch: [[0]], batch_size=None, workers=0)


# ---------------------------------------------------------------------- mixtures of streams (Shards)
def read_shard(shard):
    source, number, records = shard
    for r in range(records):
        yield source * 100_000 + number * 100 + r


def stream(source, shards, records=2, **options):
    options.setdefault("cycle_length", 2)
    return Shards([(source, i, records) for i in range(shards)], read_shard, **options)


def test_stream_mixture_draws_shards_by_weight():
    """A mixture of streams mixes shards: each shard opened is from source k with probability
    weights[k] (stop_on_empty=True: throughout), a chi-square statistic on the shards read."""
    weights = [0.6, 0.3, 0.1]
    mix = Mix([stream(0, 1000), stream(1, 1000), stream(2, 60)], weights, stop_on_empty=True)
    with Loader(mix, batch_size=None, workers=0, seed=2, seed_globals=False) as loader:
        got = [int(x) for x in loader]
    shards = Counter((x // 100_000, x // 100 % 1000) for x in got)
    assert set(shards.values()) == {2}  # every shard opened is read whole
    per_source = Counter(source for source, _ in shards)
    assert per_source[2] == 60, per_source  # the epoch ended when the rare stream ran out of shards
    observed = [per_source[0], per_source[1], per_source[2]]
    assert chi_square(observed, weights) < CHI2_DF2_P001, observed
    assert chi_square(observed, [1 / 3] * 3) > 100, observed


def test_stream_mixture_exactly_once_and_the_same_whatever_the_workers():
    def make(workers):
        mix = Mix([stream(0, 9, block_length=2), Mix([stream(1, 4, block_length=2), stream(2, 5, block_length=2)],
                                                      [1, 3])], [2, 1], with_source=True)
        return Loader(mix, batch_size=4, workers=workers, shuffle=True, seed=6, epochs=2, with_epoch=True)

    runs = {}
    for workers in (0, 2):
        with make(workers) as loader:
            runs[workers] = [(e, tuple(np.asarray(b[0]).tolist()), tuple(np.asarray(b[1]).tolist()))
                             for e, b in loader]
    assert runs[0] == runs[2]
    for epoch in (0, 1):
        tags = [t for e, ks, xs in runs[0] if e == epoch for t in zip(ks, xs, strict=True)]
        assert sorted(x for _, x in tags) == sorted(read for s, n in ((0, 9), (1, 4), (2, 5)) for i in range(n)
                                                   for read in read_shard((s, i, 2)))
        assert all(k == min(x // 100_000, 1) for k, x in tags)  # with_source: the outer source's position


def test_stream_mixture_resumes_with_the_weights_it_began_with():
    def make(weights):
        return Loader(Mix([stream(0, 6), stream(1, 6)], weights), batch_size=2, workers=2, shuffle=True, seed=3,
                      epochs=2, with_epoch=True)

    with make([1, 1]) as loader:
        full = [(e, x) for e, b in loader for x in np.asarray(b).tolist()]
    with make([1, 1]) as first:
        it = iter(first)
        taken = [(e, x) for e, b in (next(it) for _ in range(3)) for x in np.asarray(b).tolist()]
        state = json.loads(json.dumps(first.state_dict()))
    with make([1, 0]) as second:  # the second stream left out from the next epoch on
        second.load_state_dict(state)
        rest = [(e, x) for e, b in second for x in np.asarray(b).tolist()]
    assert [p for p in taken + rest if p[0] == 0] == [p for p in full if p[0] == 0]
    assert sorted(x for e, x in rest if e == 1) == sorted(x for i in range(6) for x in read_shard((0, i, 2)))


OPEN = Counter()


def counted_shard(shard):
    OPEN["now"] += 1
    OPEN["peak"] = max(OPEN["peak"], OPEN["now"])
    try:
        yield from range(shard * 10, shard * 10 + 3)
    finally:
        OPEN["now"] -= 1


def test_hundreds_of_streams_hold_open_shards_not_sources():
    """300 streams of one shard each, cycle_length=2: shards open at once stay within the stream's
    own bound (2 * cycle_length + 8 kept readers), whatever the number of sources."""
    OPEN.clear()
    mix = Mix([Shards([k], counted_shard, cycle_length=2) for k in range(300)], [1 + k % 3 for k in range(300)])
    with Loader(mix, batch_size=8, workers=0, shuffle=True, seed=1) as loader:
        got = flat(loader)
    assert sorted(got) == [x for k in range(300) for x in range(k * 10, k * 10 + 3)]
    assert OPEN["peak"] <= 2 * 2 + 8, OPEN
    assert OPEN["now"] == 0


def test_stream_mixture_checks():
    with pytest.raises(ValueError, match="cycle_length"):
        Loader(Mix([stream(0, 2, cycle_length=2), stream(1, 2, cycle_length=3)], [1, 1]), workers=0)
    with pytest.raises(TypeError, match="not indexed"):
        Mix([stream(0, 2)], [1])[0]
    with Loader(Mix([stream(0, 2, lengths=[2, 2]), stream(1, 3, lengths=[2] * 3)], [1, 1]), batch_size=4,
                workers=0) as loader:
        assert len(loader) == 3
        assert len(flat(loader)) == 10


class EpochRecords(Shards):
    """A ``Shards`` subclass that reads through its own hooks: ``open_shard`` takes the shard's
    index (not ``open_fn``), its records carry the epoch ``reading`` told it, and ``check_cache``
    refuses. Inside a mixture, each hook must still be this leaf's."""

    epoch = None

    def reading(self, epoch):
        self.epoch = epoch

    def open_shard(self, shard):
        source, i, records = self.shards[shard]
        return [10_000_000 * (self.epoch + 1) + source * 100_000 + i * 100 + r for r in range(records)]

    def check_cache(self):
        raise ValueError("EpochRecords: the records change every epoch")


def unused_open_fn(shard):
    raise AssertionError("open_fn read: the subclass's open_shard was bypassed")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shards_subclass_reads_through_its_own_hooks_inside_a_mixture(workers):
    leaf = EpochRecords([(7, i, 3) for i in range(4)], unused_open_fn, cycle_length=2)
    mix = Mix([stream(0, 5), Mix([leaf, stream(1, 2)], [1, 1])], [1, 1], with_source=True)
    with Loader(mix, batch_size=4, workers=workers, shuffle=True, seed=5, epochs=2, with_epoch=True) as loader:
        got = [(e, k, x) for e, (ks, xs) in loader for k, x in zip(np.asarray(ks).tolist(), np.asarray(xs).tolist(),
                                                                     strict=True)]
    for epoch in (0, 1):
        mine = sorted(x for e, k, x in got if e == epoch and x >= 10_000_000)
        assert mine == [10_000_000 * (epoch + 1) + 700_000 + i * 100 + r for i in range(4) for r in range(3)]
        assert {k for e, k, x in got if e == epoch and x >= 10_000_000} == {1}  # with_source: the outer source
        others = sorted(x for e, k, x in got if e == epoch and x < 10_000_000)
        assert others == sorted(x for s, n in ((0, 5), (1, 2)) for i in range(n) for x in read_shard((s, i, 2)))
    assert leaf.epoch is None  # the loader told its own copy the epoch, not the user's object
    with pytest.raises(ValueError, match="EpochRecords: the records change every epoch"):
        Loader(Mix([leaf, stream(0, 2)], [1, 1]), batch_size=2, workers=0, cache="memory")


def test_a_shard_of_a_stream_mixture_is_named_by_its_leaf_in_messages():
    mix = Mix([stream(0, 2), Shards(["a.txt", "b.txt"], broken_shard, cycle_length=2)], [1, 1])
    with Loader(mix, batch_size=2, workers=0) as loader, pytest.raises(OSError) as raised:
        list(loader)
    assert any("'b.txt': the mixture's source 1, depth first" in note for note in raised.value.__notes__), \
        raised.value.__notes__


def broken_shard(name):
    if name == "b.txt":
        raise OSError("b.txt is unreadable")
    yield from range(3)


def test_stream_mixture_ranks_split_the_shards():
    def run(rank):
        mix = Mix([stream(0, 5), stream(1, 4)], [1, 1])
        with Loader(mix, batch_size=None, workers=0, shuffle=True, seed=2, shard=(rank, 2)) as loader:
            return [int(x) for x in loader]

    ranks = [run(0), run(1)]
    assert set(ranks[0]).isdisjoint(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == sorted(x for s, n in ((0, 5), (1, 4)) for i in range(n)
                                                 for x in read_shard((s, i, 2)))
