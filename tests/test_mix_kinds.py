"""Indexed datasets and streams in one ``procpipe.Mix``: the mixture is a stream, each indexed
dataset read as shards (slices of ``shard_size`` elements of its epoch order). Proportions
(a chi-square statistic on the shards drawn, fixed seed), exactly once per epoch, the same
records whatever the worker count, a whole-dataset shuffle each epoch, and the errors.
(Resume mid-epoch: tests/test_resume_matrix.py, kind "mixkinds"; combine_states:
tests/test_elastic_mix.py.)"""
from __future__ import annotations


import numpy as np
import pytest

from procpipe import Loader, Mix, Shards

CHI2_DF1_P001 = 10.828  # the chi-square distribution's 99.9 % quantile, 1 degree of freedom


def read(shard):
    number, records = shard
    for r in range(records):
        yield 100_000 + number * 100 + r


def stream(lengths, first=0, **options):
    options.setdefault("cycle_length", 2)
    return Shards([(first + i, n) for i, n in enumerate(lengths)], read, lengths=lengths, **options)


def test_proportions_are_per_shard_of_the_streams_mean_size():
    """shard_size defaults to the streams' mean shard (20 records here): with stop_on_empty=True
    every shard opened is from the array with probability 0.25, so a quarter of the records too."""
    array = np.arange(1200)  # 60 slices of 20
    mix = Mix([array, stream([20] * 600)], [0.25, 0.75], stop_on_empty=True)
    assert mix.shard_size == 20 and len(mix) == 60 + 600
    with Loader(mix, batch_size=20, workers=0, shuffle=True, seed=4, seed_globals=False) as loader:
        got = [int(x) for batch in loader for x in batch]
    indexed = [x for x in got if x < 100_000]
    assert len(indexed) == 1200  # the epoch ended when the array ran out of slices
    shards = [len(indexed) // 20, len({x // 100 for x in got if x >= 100_000})]
    expected = np.array([0.25, 0.75]) * sum(shards)
    statistic = float(((np.array(shards) - expected) ** 2 / expected).sum())
    assert statistic < CHI2_DF1_P001, shards
    wrong = np.array([0.5, 0.5]) * sum(shards)
    assert float(((np.array(shards) - wrong) ** 2 / wrong).sum()) > 50, shards


def make(workers, epochs=2, **options):
    mix = Mix([list(range(37)), stream([5, 9, 3, 7]), np.arange(500, 510)], [1, 2, 1], with_source=True, **options)
    return Loader(mix, batch_size=4, workers=workers, shuffle=True, seed=6, epochs=epochs, with_epoch=True)


def test_exactly_once_per_epoch_the_same_whatever_the_workers_and_shuffled_whole():
    runs = {}
    for workers in (0, 2):
        with make(workers) as loader:
            runs[workers] = [(e, tuple(np.asarray(b[0]).tolist()), tuple(np.asarray(b[1]).tolist()))
                             for e, b in loader]
    assert runs[0] == runs[2]
    every = [*range(37), *(100_000 + s * 100 + r for s, n in enumerate([5, 9, 3, 7]) for r in range(n)),
             *range(500, 510)]
    per_epoch = {}
    for epoch in (0, 1):
        tagged = [t for e, ks, xs in runs[0] if e == epoch for t in zip(ks, xs, strict=True)]
        assert sorted(x for _, x in tagged) == sorted(every)  # every element and record once
        assert all(k == (0 if x < 500 else 2 if x < 100_000 else 1) for k, x in tagged)  # with_source
        per_epoch[epoch] = [x for k, x in tagged if k == 0]
    first = per_epoch[0]
    slices = [first[i:i + 6] for i in range(0, 37, 6)]  # (6: the streams' mean shard, 24 / 4)
    # each slice is read in turn, but holds elements from all over the dataset (a whole permutation)
    assert max(max(s) - min(s) for s in slices) > 6 and first != per_epoch[1]


def test_shard_size_and_its_errors():
    with make(0, epochs=1, shard_size=10) as loader:
        got = [x for _, b in loader for x in np.asarray(b[1]).tolist()]
    assert sorted(x for x in got if x < 500) == list(range(37))
    unsized = Shards([(0, 3)], read)  # no lengths: the size cannot be guessed
    with pytest.raises(ValueError, match=r"no Shards\(lengths=...\): pass Mix\(..., shard_size=N\)"):
        Mix([np.arange(5), unsized], [1, 1])
    with Loader(Mix([np.arange(5), unsized], [1, 1], shard_size=2), batch_size=None, workers=0) as loader:
        assert sorted(int(x) for x in loader) == [0, 1, 2, 3, 4, 100_000, 100_001, 100_002]
    # len() and repr() count shards in a mixture that holds a stream (3 slices of 2, and 1 shard)
    assert repr(Mix([np.arange(5), unsized], [1, 1], shard_size=2)) == "Mix(2 sources, 4 shards, stop_on_empty=False)"
    assert repr(Mix([np.arange(5), np.arange(3)], [1, 1])) == "Mix(2 sources, 8 elements, stop_on_empty=False)"
    with pytest.raises(ValueError, match="shard_size applies to an indexed dataset mixed with streams"):
        Mix([np.arange(5), np.arange(3)], [1, 1], shard_size=2)
    with pytest.raises(ValueError, match="shard_size must be an int >= 1"):
        Mix([np.arange(5), unsized], [1, 1], shard_size=0)
    with pytest.raises(TypeError, match="give its datasets to this mixture directly"):
        Mix([Mix([np.arange(5), np.arange(3)], [1, 1]), unsized], [1, 1], shard_size=2)
    with pytest.raises(ValueError, match="cache=... is not supported for a procpipe.Mix of indexed datasets and"):
        Loader(Mix([np.arange(5), stream([2])], [1, 1]), batch_size=2, workers=0, cache="memory")


def test_even_ranks_cut_the_mixed_order():
    """even_ranks=True with a mixture of streams (an indexed dataset among them): every rank reads
    the same records per epoch, counted from the mixture's order (not the unmixed shard list)."""
    world, epochs = 2, 2
    per_rank = []
    for rank in range(world):
        mix = Mix([stream([3, 17, 5, 9, 2, 11]), stream([8, 1, 14, 6], 10), np.arange(500, 530)], [1, 1, 1])
        with Loader(mix, batch_size=4, workers=0, shuffle=True, seed=1, epochs=epochs, with_epoch=True,
                    shard=(rank, world), even_ranks=True) as loader:
            got: dict[int, list[int]] = {}
            for epoch, batch in loader:
                got.setdefault(epoch, []).extend(int(x) for x in batch)
        per_rank.append(got)
    for epoch in range(epochs):
        counts = [len(got[epoch]) for got in per_rank]
        assert counts[0] == counts[1] > 0, counts
        assert set(per_rank[0][epoch]).isdisjoint(per_rank[1][epoch])


def failing(x):
    if x == 3:
        raise KeyError("no 3")
    return x


def test_an_error_names_the_slice_it_came_from():
    with Loader(Mix([np.arange(6), stream([2])], [1, 1]), fn=failing, batch_size=2, workers=0) as loader, \
            pytest.raises(KeyError) as raised:
        list(loader)
    assert any("slice 1 of the epoch order of the indexed ndarray" in note for note in raised.value.__notes__)
