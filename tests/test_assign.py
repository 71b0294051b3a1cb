"""``Loader(assign=...)``: which worker loads which batch of an indexed source.

``"round_robin"`` gives batch k of every epoch to worker ``k % workers`` (torch's
DataLoader schedule; the torch facade's default with ``in_order=True``), and still runs a
dead worker's batches elsewhere, exactly once; ``"balanced"`` (default) gives each batch to
the least busy worker.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from faultkit import BS, N, Faulty, check_epoch, reference

from procpipe import Loader


def pid_of(i):
    return np.int64(os.getpid())


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_round_robin_gives_batch_k_to_worker_k_mod_workers_every_epoch(workers):
    with Loader(list(range(40)), pid_of, batch_size=2, workers=workers, assign="round_robin", epochs=2) as loader:
        got = [int(b[0]) for b in loader]
        pids = loader.worker_pids
    assert len(got) == 40
    for epoch in (0, 1):  # (the rotation starts again with each epoch's first batch)
        assert got[epoch * 20:(epoch + 1) * 20] == [pids[k % workers] for k in range(20)]


def test_balanced_is_the_default_and_shares_batches_out():
    with Loader(list(range(64)), pid_of, batch_size=2, workers=2) as loader:
        got = {int(b[0]) for b in loader}
        assert got <= set(loader.worker_pids) and len(got) == 2


@pytest.mark.parametrize("ordered", [True, False])
def test_round_robin_runs_a_dead_workers_batches_elsewhere_exactly_once(tmp_path, ordered):
    plan = {5: "exit", 18: "sigkill"}  # batches 1 and 4: worker 1's, then worker 0's
    with Loader(list(range(N)), Faulty(tmp_path, plan), batch_size=BS, workers=2, ordered=ordered,
                assign="round_robin") as loader:
        got = [(idx.tolist(), vals.copy()) for idx, vals in loader]
        stats = loader.stats()
    check_epoch(got, reference(0), ordered)
    assert stats["worker_deaths"] == 2 and stats["redispatched_tasks"] >= 2, stats


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(assign="fastest"), "assign must be one of"),
        (dict(assign="round_robin", workers="auto"), "needs a fixed number of local workers"),
    ],
)
def test_assign_errors_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Loader(list(range(4)), **{"workers": 2, **kwargs})
