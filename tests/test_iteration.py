"""What ties an epoch iterator to its Loader (procpipe/_consumer/iteration_context.py), seen from outside.

The iterators are given an ``IterationContext`` and hold no reference to the Loader's
insides; these tests pin down what the Loader relied on them for before: an iteration
keeps its Loader (hence its engine) alive, ``loader.epoch`` follows the consumer unless
the user set it meanwhile, and ``stats()`` sees the running iteration.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

from procpipe import Loader, Shards

N, BS = 40, 4


def open_shard(shard):
    return iter(range(shard * 100, shard * 100 + 10))


def source(kind):
    return list(range(N)) if kind == "indexed" else Shards([0, 1, 2, 3], open_shard, cycle_length=2)


def flat(batches):
    return sorted(int(x) for batch in batches for x in np.asarray(batch).ravel())


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["indexed", "shards"])
def test_iterating_an_unnamed_loader_keeps_it_alive(kind, workers):
    """``for batch in Loader(...)``: nothing else holds the Loader, yet every batch comes."""
    got = []
    for batch in Loader(source(kind), batch_size=BS, workers=workers):
        gc.collect()  # a Loader collected here would close its engine under the iteration
        got.append(np.array(batch))
    want = list(range(N)) if kind == "indexed" else [s * 100 + i for s in range(4) for i in range(10)]
    assert flat(got) == want


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["indexed", "shards"])
def test_epoch_follows_the_consumer_unless_set_meanwhile(kind, workers):
    with Loader(source(kind), batch_size=BS, workers=workers, epochs=3, with_epoch=True) as loader:
        it = iter(loader)
        epochs = []
        for epoch, _ in it:
            epochs.append(epoch)
            assert loader.epoch == epoch + 1  # the epoch after the one of the batch just returned
            assert loader.stats()["running"] and loader.stats()["epoch"] == epoch
            if epoch == 1:
                break
        loader.set_epoch(7)  # the user's choice wins over the iteration still going on
        for epoch, _ in it:
            epochs.append(epoch)
        assert loader.epoch == 7 and sorted(set(epochs)) == [0, 1, 2]
        assert not loader.stats()["running"]
        assert next(iter(loader))[0] == 7
