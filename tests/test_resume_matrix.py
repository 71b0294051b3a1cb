"""One resume test for every source kind (torchdata's ``run_test_save_load_state`` idea):
{indexed, shards, mix, mixed shards, indexed + shards mixed} x {workers 0, 2} x {ordered, sloppy} with N epochs,
and 1 epoch pairwise. Iterate ``k`` batches,
``state_dict()`` (through JSON), load it into a NEW loader and finish: every item is delivered
exactly once per epoch, and with ``ordered=True`` the batches are those of an uninterrupted run."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from procpipe import Loader, Mix, Shards

EPOCHS = 3
INDEXED = list(range(30))  # 8 batches of 4 per epoch (the last one short)
SHARDS = [(0, 7), (1, 0), (2, 9), (3, 12), (4, 2)]  # (shard id, records): 30 records
MIXED = [list(range(100, 112)), list(range(200, 205)), list(range(300, 313))]  # a Mix of 30 elements


def open_shard(shard):
    for i in range(shard[1]):
        yield shard[0] * 100 + i


def items_of_epoch(kind):
    if kind == "mixkinds":
        return sorted([*MIXED[0], *(s * 100 + i for s, n in SHARDS[2:] for i in range(n))])
    if kind == "mixshards":
        kind = "shards"
    if kind == "mix":
        return sorted(x for source in MIXED for x in source)
    return sorted(INDEXED) if kind == "indexed" else sorted(s * 100 + i for s, n in SHARDS for i in range(n))


def make(kind, workers, ordered, epochs):
    if kind == "mix":  # the weights change every epoch (a schedule), and the 2nd source is itself a mixture
        source = Mix([MIXED[0], Mix([MIXED[1], MIXED[2]], [1, 2])], lambda epoch: [0.2 + 0.3 * epoch, 0.5])
    elif kind == "mixshards":  # a mixture of two streams, with a schedule: shards opened in a mixed order
        source = Mix([Shards(SHARDS[:2], open_shard, cycle_length=2, block_length=3),
                      Shards(SHARDS[2:], open_shard, cycle_length=2, block_length=3)], lambda epoch: [1 + epoch, 2])
    elif kind == "mixkinds":  # an indexed source beside a stream: read as slices of its epoch order
        source = Mix([MIXED[0], Shards(SHARDS[2:], open_shard, cycle_length=2, block_length=3)],
                     lambda epoch: [1 + epoch, 2], shard_size=5)
    else:
        source = INDEXED if kind == "indexed" else Shards(SHARDS, open_shard, cycle_length=2, block_length=3)
    return Loader(source, batch_size=4, workers=workers, ordered=ordered, epochs=epochs, shuffle=True, seed=11,
                  with_epoch=True)


def tagged(pair):
    epoch, batch = pair
    return epoch, [int(x) for x in np.asarray(batch).reshape(-1)]


KINDS = ["indexed", "shards", "mix", "mixshards", "mixkinds"]
# Every {kind} x {workers} x {ordered} with EPOCHS epochs (cut in the first epoch and in a
# later one); a single epoch (a resumed loader that must stop after it) in four of them,
# chosen so that epochs=1 meets every kind, both worker counts, both orders and every
# (workers, ordered) pair: the cut in the first epoch is the same test in both.
ONE_EPOCH = [("indexed", 0, True), ("shards", 2, True), ("mix", 0, False), ("mixshards", 2, False),
             ("mixkinds", 0, True)]
MATRIX = [pytest.param(kind, workers, ordered, EPOCHS, id=f"{kind}-{workers}-{'ordered' if ordered else 'sloppy'}-{EPOCHS}")
          for kind in KINDS for workers in (0, 2) for ordered in (True, False)]
MATRIX += [pytest.param(kind, workers, ordered, 1, id=f"{kind}-{workers}-{'ordered' if ordered else 'sloppy'}-1")
           for kind, workers, ordered in ONE_EPOCH]


def test_the_single_epoch_cases_cover_every_value_and_pair():
    assert {k for k, _, _ in ONE_EPOCH} == set(KINDS)
    assert {(w, o) for _, w, o in ONE_EPOCH} == {(w, o) for w in (0, 2) for o in (True, False)}


@pytest.mark.parametrize(("kind", "workers", "ordered", "epochs"), MATRIX)
def test_save_load_state(kind, workers, ordered, epochs):
    with make(kind, workers, ordered, epochs) as loader:
        full = [tagged(p) for p in loader]
    per_epoch = len(full) // epochs
    # Cut early in the first epoch, and (with epochs=N) inside a later one.
    cuts = [3] + ([per_epoch + 2] if epochs > 1 else [])
    for k in cuts:
        with make(kind, workers, ordered, epochs) as first:
            it = iter(first)
            taken = [tagged(next(it)) for _ in range(k)]
            state = json.loads(json.dumps(first.state_dict()))
        with make(kind, workers, ordered, epochs) as second:
            second.load_state_dict(state)
            rest = [tagged(p) for p in second]
        got = taken + rest
        counts = Counter((e, x) for e, batch in got for x in batch)
        expected = Counter((e, x) for e in range(epochs) for x in items_of_epoch(kind))
        assert counts == expected, (k, state)
        if ordered:
            assert got == full, (k, state)
