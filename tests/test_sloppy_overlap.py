"""A sloppy endless stream whose epoch 0 ends last: positions and resume, made deterministic.

With ``ordered=False`` the epochs overlap: while one worker is stuck on epoch 0's last batch,
the other delivers batches of epochs 1, 2, 3... These tests hold that batch back on purpose
(``fn`` waits while a file exists, for the one sample of epoch 0 that sample_rng() tells
apart), so the interleaving a loaded machine produces by chance happens every time.
"""
from __future__ import annotations

import os
import time

import pytest
from conftest import wait_gone, wait_until

import procpipe
from procpipe import Loader

N, BS, SEED = 40, 4, 5  # 10 batches per epoch
EPOCH = N // BS


class HoldOne:
    """``fn``: the test's sample, except that the sample whose ``r`` is ``target`` (one index
    of epoch 0: ``r`` depends on seed, epoch and index) waits while ``folder/hold`` exists,
    after writing ``folder/reached``."""

    def __init__(self, folder: str, target: int) -> None:
        self.hold = os.path.join(folder, "hold")
        self.reached = os.path.join(folder, "reached")
        self.target = target

    def __call__(self, i):
        r = int(procpipe.sample_rng().integers(1 << 30))
        if r == self.target:
            with open(self.reached, "a") as f:
                f.write("x")
            while os.path.exists(self.hold):  # the gate: the test removes the file to release it
                time.sleep(0.005)
        return {"i": i, "r": r}


def key(batch):
    return (tuple(int(x) for x in batch["i"]), tuple(int(x) for x in batch["r"]))


def reference(epochs):
    """Each epoch's batches, from one plain iteration per epoch with workers=0."""
    with Loader(list(range(N)), HoldOne("/nonexistent", -1), batch_size=BS, workers=0, shuffle=True,
                seed=SEED) as loader:
        return [[key(b) for b in loader] for _ in range(epochs)]


@pytest.fixture
def gate(tmp_path):
    """``(fn, hold)``: ``fn`` holds epoch 0's last batch back while ``hold`` exists (it does at first)."""
    ref = reference(40)
    target = ref[0][-1][1][0]  # r of the first sample of epoch 0's last batch
    assert all(target not in rs for epoch in ref[1:] for _, rs in epoch)  # nothing else is held (epochs < 40)
    hold = tmp_path / "hold"
    hold.touch()
    return HoldOne(str(tmp_path), target), hold, ref


def per_epoch(got):
    out = {}
    for epoch, k in got:
        out.setdefault(epoch, []).append(k)
    return out


def complete(got, epoch):
    return len(per_epoch(got).get(epoch, ())) == EPOCH


def take_until(it, got, condition, most=500):
    """Batches from ``it`` into ``got`` until ``condition(got)``; fails past ``most`` batches."""
    for _ in range(most):
        if condition(got):
            return
        epoch, batch = next(it)
        got.append((epoch, key(batch)))
    assert condition(got), f"not reached after {most} batches: {epoch_counts(got)}"


def epoch_counts(got):
    """Batches returned per epoch (for failure messages)."""
    return {e: len(batches) for e, batches in sorted(per_epoch(got).items())}


def test_state_taken_as_held_batches_end_their_epochs_names_the_oldest_epoch_not_complete(gate):
    """While epoch 0's last batch is held, its worker's queue waits behind it and the other worker
    runs epochs ahead; once released, the held batches complete epoch 0 (and perhaps later ones) after
    later epochs were complete. A state taken then must name the oldest epoch not complete,
    with every later one it touched in ``ahead``, and resume exactly once from there."""
    fn, hold, ref = gate
    with Loader(list(range(N)), fn, batch_size=BS, workers=2, ordered=False, epochs=None, with_epoch=True,
                shuffle=True, seed=SEED) as loader:
        pids = loader.worker_pids
        it = iter(loader)
        got = []
        # Three later epochs complete while epoch 0's last batch is held. (Which ones depends on
        # when the held worker's queue filled: the tasks queued behind the held one, up to
        # three, may belong to epoch 1, 2 or later, and wait with it.)
        take_until(it, got, lambda g: sum(complete(g, e) for e in per_epoch(g) if e > 0) >= 3)
        assert not complete(got, 0)  # its last batch is held: later epochs ended before it
        hold.unlink()
        saved = None
        for _ in range(500):
            if all(complete(got, e) for e in range(5)):
                break
            epoch, batch = next(it)
            got.append((epoch, key(batch)))
            del batch
            state = loader.state_dict()
            oldest = min(e for e in range(max(per_epoch(got)) + 2) if not complete(got, e))
            assert state["epoch"] == oldest, (state, epoch_counts(got))
            assert [entry[0] for entry in state["ahead"]] == [e for e in sorted(per_epoch(got)) if e > oldest]
            if saved is None and complete(got, epoch) and complete(got, epoch + 1):  # its end marker unread
                saved, before = state, list(got)
        assert saved is not None, epoch_counts(got)  # the held batch ended its epoch after the next one
        loader.load_state_dict(saved)
        ring = loader._coordinator.ring
        wait_until(lambda: len(ring.free) == ring.slots, 10, "every ring slot back after the break")
        rest = []
        last = max(per_epoch(before))
        take_until(iter(loader), rest, lambda g: all(complete(before + g, e) for e in range(last + 1)))
    assert wait_gone(pids) == []
    full = per_epoch(before + rest)
    for e in range(last + 1):  # exactly once, with the bytes of an uninterrupted run
        assert sorted(full[e]) == sorted(ref[e]), f"epoch {e}"


def test_resumed_sloppy_stream_returns_epoch_zeros_held_batch_late_and_once(gate):
    """The flake of test_epochs' endless-stream test, made to happen: after the resume, epoch 0's
    last batch may come after any number of later batches (here 40), never lost or doubled."""
    fn, hold, ref = gate
    reached = os.path.join(os.path.dirname(fn.hold), "reached")
    with Loader(list(range(N)), fn, batch_size=BS, workers=2, ordered=False, epochs=None, with_epoch=True,
                shuffle=True, seed=SEED) as loader:
        pids = loader.worker_pids
        it = iter(loader)
        got = []
        take_until(it, got, lambda g: len(g) == 35)
        epochs = per_epoch(got)
        assert not complete(got, 0) and max(epochs) >= 3
        state = loader.state_dict()
        assert state["epoch"] == 0 and state["until"] is None
        assert [entry[0] for entry in state["ahead"]] == [e for e in sorted(epochs) if e > 0]
        loader.load_state_dict(state)
        hold.unlink()  # the old stream's held attempt ends (its reply is discarded)
        ring = loader._coordinator.ring
        wait_until(lambda: len(ring.free) == ring.slots, 10, "every ring slot back after the break")
        os.remove(reached)
        hold.touch()  # the resumed stream's attempt of that batch is held again
        it = iter(loader)
        rest = []
        take_until(it, rest, lambda g: len(g) == 40)
        assert os.path.exists(reached)
        assert not complete(got + rest, 0)  # 40 batches after the resume, epoch 0 is not complete yet
        hold.unlink()
        take_until(it, rest, lambda g: all(complete(got + g, e) for e in range(4)))
    assert wait_gone(pids) == []
    full = per_epoch(got + rest)
    for e in range(4):  # exactly once, with the bytes of an uninterrupted run
        assert sorted(full[e]) == sorted(ref[e]), f"epoch {e}"
