"""``procpipe.combine_states`` for mixtures (``procpipe.Mix``): the states of every rank of a run
over an indexed mixture, or a mixture of streams (with an indexed source among them), combined
and resumed on fewer ranks: exactly once, the saved epoch keeps the weights it began with, and
states that do not belong together are refused."""
from __future__ import annotations

import json

import numpy as np
import pytest

from procpipe import Loader, Mix, Shards, combine_states

A, B, C = np.arange(0, 60), np.arange(1000, 1025), np.arange(2000, 2018)  # 103 elements


def _mix(weights=(2, 1)):
    return Mix([A, Mix([B, C], [1, 2])], list(weights))


def _indexed(shard, weights=(2, 1), **kwargs) -> Loader:
    return Loader(_mix(weights), **{"batch_size": 4, "workers": 0, "shuffle": True, "seed": 5, "shard": shard,
                                    **kwargs})


def _flat(batches) -> list[int]:
    return [int(i) for b in batches for i in np.atleast_1d(b)]


def _take(loader: Loader, batches: int) -> tuple[list, dict]:
    it = iter(loader)
    got = [next(it) for _ in range(batches)]
    return got, json.loads(json.dumps(loader.state_dict()))


def _saved(make, taken) -> tuple[list, list[dict]]:
    """Every old rank (one per entry of ``taken``) takes that many batches (None: its whole epoch)
    and saves: the values delivered, and the states."""
    delivered, states = [], []
    for rank, count in enumerate(taken):
        with make((rank, len(taken))) as loader:
            if count is None:
                got, state = list(loader), json.loads(json.dumps(loader.state_dict()))
                assert state["epoch"] == 1
            else:
                got, state = _take(loader, count)
        delivered += _flat(got)
        states.append(state)
    return delivered, states


@pytest.mark.parametrize("new_world", [2, 3])
def test_combine_states_indexed_mix_4_ranks_to_fewer_exactly_once(new_world):
    delivered, states = _saved(_indexed, [3, 5, 0, None])
    combined = combine_states(states[::-1])
    assert combined["mix_weights"] == [[0, [[2.0, 1.0], [1.0, 2.0]]]]
    rest = []
    for rank in range(new_world):
        # new weights: the saved epoch keeps the ones it began with, the next takes these
        with _indexed((rank, new_world), weights=(1, 4), workers=2 if rank == 0 else 0) as loader:
            loader.load_state_dict(combined)
            rest += _flat(loader)  # the rest of epoch 0
            next_epoch = [b.tolist() for b in loader]
        with _indexed((rank, new_world), weights=(1, 4)) as fresh:
            fresh.set_epoch(1)
            assert next_epoch == [b.tolist() for b in fresh]
    assert len(rest) == len(set(rest))  # (the old ranks' padding repeats one element: delivered as a set)
    assert sorted(rest + list(set(delivered))) == sorted([*A.tolist(), *B.tolist(), *C.tolist()])


def test_combine_states_indexed_mix_again_within_the_resumed_epoch():
    """4 ranks -> 2 ranks, which save mid-epoch -> combined again -> 3 ranks: still exactly once."""
    delivered, states = _saved(_indexed, [2, 4, 1, 3])
    second = []
    for rank, taken in enumerate([3, 1]):
        with _indexed((rank, 2)) as loader:
            loader.load_state_dict(combine_states(states))
            got, state = _take(loader, taken)
        delivered += _flat(got)
        second.append(state)
    rest = []
    combined = combine_states(second)
    for rank in range(3):
        with _indexed((rank, 3)) as loader:
            loader.load_state_dict(combined)
            rest += _flat(loader)
    assert len(delivered) == len(set(delivered)) and len(rest) == len(set(rest))
    assert sorted(rest + delivered) == sorted([*A.tolist(), *B.tolist(), *C.tolist()])


# ---------------------------------------------------------------------- mixtures of streams
def _read(shard):
    source, number, records = shard
    for r in range(records):
        yield source * 100_000 + number * 100 + r


def _stream(source, records):
    return Shards([(source, i, n) for i, n in enumerate(records)], _read, lengths=records, cycle_length=2,
                  block_length=2)


INDEXED = np.arange(900_000, 900_023)  # read as slices of 4 elements (the streams' mean shard)
STREAMS = {0: [5, 3, 6, 2, 4, 7, 1], 1: [4, 4, 3, 5, 2]}


def _stream_mix(weights=(2, 1, 1)):
    return Mix([_stream(0, STREAMS[0]), Mix([_stream(1, STREAMS[1]), INDEXED], [1, 1])], list(weights))


def _streams(shard, weights=(2, 1, 1), **kwargs) -> Loader:
    mix = _stream_mix(weights[:1] + (1,))
    mix.sources[1].set_weights(list(weights[1:]))
    return Loader(mix, **{"batch_size": 3, "workers": 0, "shuffle": True, "seed": 9, "shard": shard, **kwargs})


def _every_record() -> list[int]:
    streams = [x for s, lengths in STREAMS.items() for i, n in enumerate(lengths) for x in _read((s, i, n))]
    return sorted(streams + INDEXED.tolist())


@pytest.mark.parametrize("new_world", [2, 3])
def test_combine_states_stream_mix_4_ranks_to_fewer_exactly_once(new_world):
    def old(shard):  # rank 2 reads with workers, rank 0 unordered
        return _streams(shard, workers=2 if shard[0] == 2 else 0, ordered=shard[0] != 0)

    delivered, states = _saved(old, [2, 0, 3, None])
    combined = combine_states(states)
    assert combined["mix_weights"] == [[0, [[2.0, 1.0], [1.0, 1.0]]]]
    rest = []
    for rank in range(new_world):
        with _streams((rank, new_world), weights=(1, 0, 1), workers=2 if rank == 1 else 0) as loader:
            loader.load_state_dict(combined)
            rest += _flat(loader)
    assert len(delivered) == len(set(delivered)) and len(rest) == len(set(rest))
    assert sorted(rest + delivered) == _every_record()


def test_combine_states_refuses_mixtures_that_differ():
    _, states = _saved(_indexed, [1, 1, 1])
    with pytest.raises(ValueError, match=r"other settings than states\[0\] \(seed\)"):
        combine_states([states[0], {**states[1], "seed": 6}, states[2]])
    with Loader(Mix([A[:50], Mix([B, C], [1, 2])], [2, 1]), batch_size=4, workers=0, shuffle=True, seed=5,
                shard=(1, 3)) as other:
        _, other_state = _take(other, 1)  # another structure (a shorter first source)
    with pytest.raises(ValueError, match=r"other settings than states\[0\] \(length, mix\)"):
        combine_states([states[0], other_state, states[2]])
    with _indexed((1, 3), weights=(1, 1)) as reweighted:
        _, reweighted_state = _take(reweighted, 1)
    with pytest.raises(ValueError, match="ranks 0 and 1 drew epoch 0 of their procpipe.Mix with different weights"):
        combine_states([states[0], reweighted_state, states[2]])
    with Loader(np.arange(103), batch_size=4, workers=0, shuffle=True, seed=5, shard=(1, 3)) as plain:
        _, plain_state = _take(plain, 1)
    with pytest.raises(ValueError, match=r"other settings than states\[0\] \(mix\)"):
        combine_states([states[0], plain_state, states[2]])
    combined = combine_states(states)
    with pytest.raises(ValueError, match="itself a combined state"):
        combine_states([combined])
    with Loader(Mix([A, Mix([B, C[:-1], C[-1:]], [1, 2, 1])], [2, 1]), batch_size=4, workers=0, shuffle=True,
                seed=5, shard=(0, 2)) as mismatch, pytest.raises(ValueError, match="mix="):
        mismatch.load_state_dict(combined)  # the same length, another mixture: the usual check names it
    _, stream_states = _saved(_streams, [1, 0])
    stream_combined = combine_states(stream_states)
    with pytest.raises(ValueError, match="itself a combined state"):
        combine_states([stream_combined])
    with _streams((0, 2)) as loader, pytest.raises(ValueError, match="no mix_weights for epoch"):
        loader.load_state_dict({**stream_combined, "mix_weights": [[3, [[1.0, 1.0], [1.0, 1.0]]]]})
