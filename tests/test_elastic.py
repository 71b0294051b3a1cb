"""Training at scale: even ranks for streams (``Loader(even_ranks=True)``) and elastic resume
(``procpipe.combine_states``)."""
from __future__ import annotations

import numpy as np
import pytest

from procpipe import Loader, Shards

LENGTHS = [5, 17, 3, 9, 12, 1, 8, 14, 2, 6]


def _records(shard):
    return ((shard, i) for i in range(LENGTHS[shard]))


def _shards(**kwargs) -> Shards:
    return Shards(list(range(len(LENGTHS))), _records, lengths=LENGTHS, **kwargs)


def _keys(batch) -> list[tuple[int, int]]:
    """The record keys of a batch: a pair of arrays (shards, records), or one record (batch_size=None)."""
    shards, records = batch
    return [(int(s), int(r)) for s, r in zip(np.atleast_1d(shards), np.atleast_1d(records), strict=True)]


def _epochs(loader: Loader) -> list[list[list[tuple[int, int]]]]:
    """Every epoch's batches (as record keys) of one full iteration."""
    out: dict[int, list] = {}
    for epoch, batch in loader:
        out.setdefault(epoch, []).append(_keys(batch))
    return [out[e] for e in sorted(out)]


def _epochs_of(loader: Loader) -> list:
    return list(loader)


# --------------------------------------------------------------------------- even ranks
def _pairs(records):
    """collate_fn: the records as they are (batches never span blocks)."""
    return (np.array([r[0] for r in records]), np.array([r[1] for r in records]))


@pytest.mark.parametrize("workers, kwargs", [(0, {"batch_size": 4}), (2, {"batch_size": 4, "drop_last": True}),
                                             (0, {"batch_size": None}), (0, {"batch_size": 3, "shuffle_buffer": 8}),
                                             (0, {"batch_size": 2, "collate_fn": _pairs}),
                                             (2, {"batch_size": 2, "collate_fn": _pairs, "drop_last": True})])
def test_even_ranks_give_every_rank_the_same_batches(workers, kwargs):
    world, epochs = 3, 2
    per_rank = []
    for rank in range(world):
        block = 5 if "collate_fn" in kwargs else None  # (chunks of 2 that do not fill a block of 5)
        with Loader(_shards(cycle_length=2, block_length=block), workers=workers, shuffle=True, seed=7,
                    shard=(rank, world), even_ranks=True, epochs=epochs, with_epoch=True, **kwargs) as loader:
            per_rank.append(_epochs(loader))
        with Loader(_shards(cycle_length=2, block_length=block), workers=0, shuffle=True, seed=7, reshuffle=False,
                    shard=(rank, world), even_ranks=True, **kwargs) as same_every_epoch:
            assert len(same_every_epoch) == len(_epochs_of(same_every_epoch))  # len() is what comes
    counts = {tuple(len(e) for e in eps) for eps in per_rank}
    assert len(counts) == 1, counts  # the same batches per epoch on every rank (shards move between epochs)
    for epoch in range(epochs):
        seen = [key for eps in per_rank for batch in eps[epoch] for key in batch]
        assert len(seen) == len(set(seen))  # ranks never share a record
        records = [sum(len(b) for b in eps[epoch]) for eps in per_rank]
        if not kwargs.get("drop_last") and "collate_fn" not in kwargs:
            assert len(set(records)) == 1  # every rank read exactly R records (with collate_fn: B batches)


def test_even_ranks_drop_the_last_records_of_the_larger_ranks():
    """The policy (drop): each rank reads R = the fewest records of any rank; a rank with more
    leaves out the last records of its shard order. Without even_ranks the counts differ."""
    world = 3
    uneven = [len(Loader(_shards(), batch_size=2, workers=0, shard=(r, world))) for r in range(world)]
    assert len(set(uneven)) > 1  # the case to fix: ranks 0..2 have 35, 33 and 17 records here
    totals = [sum(LENGTHS[s] for s in range(r, len(LENGTHS), world)) for r in range(world)]
    fewest = min(totals)
    for rank in range(world):
        loader = Loader(_shards(), batch_size=2, workers=0, shard=(rank, world), even_ranks=True)
        keys = [key for batch in loader for key in _keys(batch)]
        assert len(keys) == fewest and len(loader) == -(-fewest // 2)
        expected = [(s, i) for s in range(rank, len(LENGTHS), world) for i in range(LENGTHS[s])]
        assert sorted(keys) == sorted(expected[:fewest])  # the first R of its shard order, the rest left out


def test_even_ranks_resume_mid_epoch():
    rank, world = 0, 3
    kwargs = dict(batch_size=3, workers=2, shuffle=True, seed=3, shard=(rank, world), even_ranks=True)
    with Loader(_shards(cycle_length=2), **kwargs) as loader:
        whole = [_keys(b) for b in loader]
    with Loader(_shards(cycle_length=2), **kwargs) as loader:
        it = iter(loader)
        head = [_keys(next(it)) for _ in range(4)]
        state = loader.state_dict()
    assert state.get("even_ranks") is True
    with Loader(_shards(cycle_length=2), **kwargs) as loader:
        loader.load_state_dict(state)
        tail = [_keys(b) for b in loader]
    assert head + tail == whole
    with Loader(_shards(cycle_length=2), **{**kwargs, "even_ranks": False}) as other, \
            pytest.raises(ValueError, match="even_ranks"):
        other.load_state_dict(state)


def test_even_ranks_bad_arguments():
    with pytest.raises(ValueError, match="without the shards' record counts"):
        Loader(Shards([0, 1], _records), batch_size=2, workers=0, shard=(0, 2), even_ranks=True)
    with pytest.raises(ValueError, match="needs? shard=|has no shard="):
        Loader(_shards(), batch_size=2, workers=0, even_ranks=True)
    with pytest.raises(TypeError, match="even_ranks must be True or False"):
        Loader(_shards(), batch_size=2, workers=0, shard=(0, 2), even_ranks=1)
    # an indexed source's ranks are already even (padded, as DistributedSampler): accepted, the same batches
    plain = [b.tolist() for b in Loader(np.arange(10), batch_size=3, workers=0, shard=(1, 3))]
    even = [b.tolist() for b in Loader(np.arange(10), batch_size=3, workers=0, shard=(1, 3), even_ranks=True)]
    assert plain == even


# --------------------------------------------------------------------------- combine_states
N = 103


def _take(loader: Loader, batches: int) -> tuple[list, dict]:
    """The first ``batches`` batches of an iteration (as lists), then the loader's state."""
    it = iter(loader)
    got = [next(it) for _ in range(batches)]
    return got, loader.state_dict()


def _indexed(shard, **kwargs) -> Loader:
    return Loader(np.arange(N), **{"batch_size": 4, "workers": 0, "shuffle": True, "seed": 5, "shard": shard, **kwargs})


def _flat(batches) -> list[int]:
    return [int(i) for b in batches for i in np.atleast_1d(b)]


@pytest.mark.parametrize("new_world", [2, 3])
def test_combine_states_indexed_4_ranks_to_fewer_exactly_once(new_world):
    from procpipe import combine_states

    delivered, states = [], []
    for rank, taken in enumerate([3, 5, 0, None]):
        with _indexed((rank, 4)) as loader:
            if taken is None:  # this rank finished its part of the epoch: its state is at epoch 1
                got, state = list(loader), loader.state_dict()
                assert state["epoch"] == 1
            else:
                got, state = _take(loader, taken)
        delivered += _flat(got)
        states.append(state)
    combined = combine_states(states[::-1])  # any order
    rest = []
    for rank in range(new_world):
        with _indexed((rank, new_world), workers=2 if rank == 0 else 0) as loader:
            loader.load_state_dict(combined)
            rest += list(loader)  # the rest of epoch 0 (the saved iteration's end)
            next_epoch = [b.tolist() for b in loader]  # epoch 1
        with _indexed((rank, new_world)) as fresh:
            fresh.set_epoch(1)
            assert next_epoch == [b.tolist() for b in fresh]  # later epochs: an uninterrupted run's
    rest = _flat(rest)
    assert len(rest) == len(set(rest))  # exactly once across the new ranks
    assert sorted(rest + list(set(delivered))) == list(range(N))  # every index not delivered, none delivered


def test_combine_states_again_within_the_resumed_epoch():
    """4 ranks -> 2 ranks, which save mid-epoch -> combined again -> 3 ranks: still exactly once."""
    from procpipe import combine_states

    delivered, states = [], []
    for rank, taken in enumerate([2, 4, 1, 3]):
        with _indexed((rank, 4)) as loader:
            got, state = _take(loader, taken)
        delivered += _flat(got)
        states.append(state)
    second = []
    for rank, taken in enumerate([3, 1]):
        with _indexed((rank, 2)) as loader:
            loader.load_state_dict(combine_states(states))
            got, state = _take(loader, taken)
        delivered += _flat(got)
        second.append(state)
    # a state saved in the resumed epoch resumes its own rank exactly (and no other)
    with _indexed((0, 2)) as loader:
        loader.load_state_dict(second[0])
        own_rest = _flat(loader)
    with _indexed((1, 2)) as loader, pytest.raises(ValueError, match="saved by rank 0 of 2"):
        loader.load_state_dict(second[0])
    combined = combine_states(second)
    rest = []
    for rank in range(3):
        with _indexed((rank, 3)) as loader:
            loader.load_state_dict(combined)
            rest += _flat(loader)
    assert len(delivered) == len(set(delivered))
    assert len(rest) == len(set(rest)) and sorted(rest + delivered) == list(range(N))
    assert set(own_rest) <= set(rest)


@pytest.mark.parametrize("new_world", [2, 3])
def test_combine_states_shards_4_ranks_to_fewer_exactly_once(new_world):
    from procpipe import combine_states

    delivered, states = [], []
    for rank, taken in enumerate([2, 0, 3, None]):
        with Loader(_shards(cycle_length=2, block_length=2), batch_size=3, workers=2 if rank == 2 else 0,
                    shuffle=True, seed=9, shard=(rank, 4), ordered=rank != 0) as loader:
            if taken is None:  # this rank finished its part of the epoch
                got, state = list(loader), loader.state_dict()
            else:
                got, state = _take(loader, taken)
        delivered += [key for batch in got for key in _keys(batch)]
        states.append(state)
    combined = combine_states(states)
    rest = []
    for rank in range(new_world):
        with Loader(_shards(cycle_length=2, block_length=2), batch_size=3, workers=0, shuffle=True, seed=9,
                    shard=(rank, new_world)) as loader:
            loader.load_state_dict(combined)
            rest += [key for batch in loader for key in _keys(batch)]
    everything = [(s, i) for s in range(len(LENGTHS)) for i in range(LENGTHS[s])]
    assert len(delivered) == len(set(delivered)) and len(rest) == len(set(rest))
    assert sorted(rest + delivered) == everything


def test_combine_states_bad_input():
    from procpipe import combine_states

    states = []
    for rank in range(3):
        with _indexed((rank, 3)) as loader:
            states.append(_take(loader, 1)[1])
    with pytest.raises(ValueError, match="every rank of one run, each once"):
        combine_states(states[:2])
    with pytest.raises(ValueError, match="every rank of one run, each once"):
        combine_states([states[0], states[0], states[2]])
    with pytest.raises(ValueError, match="other settings than states\\[0\\] \\(seed\\)"):
        combine_states([states[0], {**states[1], "seed": 6}, states[2]])
    with pytest.raises(TypeError, match="a list of state dicts"):
        combine_states(states[0])
    with Loader(_shards(), batch_size=2, workers=0, shard=(1, 3)) as loader:
        stream_state = loader.state_dict()
    with pytest.raises(ValueError, match="mix an indexable source and a streaming source"):
        combine_states([states[0], stream_state, states[2]])
    with Loader(np.arange(N), batch_size=4, workers=0, batches=lambda e: [[0, 1]]) as explicit, \
            pytest.raises(ValueError, match="batches=..."):
        explicit.load_state_dict(combine_states(states))
