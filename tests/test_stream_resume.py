"""Resuming a streaming source (procpipe.Shards) with state_dict()/load_state_dict(): every record
the consumer received is never delivered again, every other one exactly once; with ordered=True the
rest of the epoch is the very sequence of batches of the uninterrupted run. Any worker counts before
and after (0 included), every batching mode, epochs=N/None, the shuffle buffer, and refused states."""
from __future__ import annotations

import gc
import json
import threading

import numpy as np
import pytest
from conftest import wait_until
from test_streaming import ALL, SHARDS, gated_open, open_shard, pad_collate, summarize

from procpipe import Loader, Shards
from procpipe._engine.epochs import Epoch
from procpipe._sources.stream import ShardPlan


def make(workers, cycle_length=3, block_length=4, shards=SHARDS, open_fn=open_shard, fn=None, **kwargs):
    kwargs.setdefault("batch_size", 5)
    return Loader(Shards(shards, open_fn, cycle_length=cycle_length, block_length=block_length), fn,
                  workers=workers, **kwargs)


def records_of(batch):
    """The record ids in what the loader yields, whatever the batching mode."""
    if isinstance(batch, np.ndarray):  # pad_collate
        return [int(v) for v in batch[:, 0]]
    ids_ = batch["id"]
    return [int(ids_[0])] if ids_.ndim == 1 else [int(v) for v in ids_[:, 0]]


def interrupted(cut, before, after, **kwargs):
    """``cut`` items from a loader with ``before`` workers, its state through JSON, then the rest
    from a new loader with ``after`` workers: (items before, state, items after), as record ids."""
    with make(before, **kwargs) as first:
        it = iter(first)
        taken = [records_of(next(it)) for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))
    with make(after, **kwargs) as second:
        second.load_state_dict(state)
        assert second.state_dict() == state  # loaded, not yet iterated: the same state
        rest = [records_of(b) for b in second]
    return taken, state, rest


def uninterrupted(**kwargs):
    with make(2, **kwargs) as loader:
        return [records_of(b) for b in loader]


def flat(items):
    return [r for item in items for r in item]


# --------------------------------------------------------------------------- mid-epoch
@pytest.mark.parametrize("before, after", [(2, 0), (0, 2), (1, 2), (2, 1)])
@pytest.mark.parametrize("ordered", [True, False])
def test_resume_mid_epoch_delivers_every_record_once(before, after, ordered):
    full = uninterrupted(ordered=ordered) if ordered else None
    for cut in (1, 6):
        taken, state, rest = interrupted(cut, before, after, ordered=ordered)
        assert sorted(flat(taken + rest)) == ALL, (cut, state)
        if ordered:  # the very batches the uninterrupted epoch gives after the first ``cut``
            assert taken + rest == full, (cut, state)
        assert state["epoch"] == 0 and state["stream"] is not None


def test_a_state_taken_inside_a_block_resumes_inside_it():
    # Blocks of 4, batches of 3: the first batch is records 0-2 of shard 0's first block.
    full = uninterrupted(batch_size=3)
    taken, state, rest = interrupted(1, 2, 2, batch_size=3)
    assert state["stream"] == {"cursor": [0, 1, [[0, 0], None, None]], "complete": [], "received": [[0, 0, 3]]}
    assert taken + rest == full
    assert rest[0] == [3, 2000, 2001]  # record 3 of shard 0, then (shard 1 being empty) shard 2's first block


def test_a_resume_of_a_resume():
    full = uninterrupted(ordered=True)
    with make(2) as first:
        it = iter(first)
        taken = [records_of(next(it)) for _ in range(2)]
        state = first.state_dict()
    with make(0) as second:
        second.load_state_dict(state)
        it = iter(second)
        taken += [records_of(next(it)) for _ in range(5)]
        state = second.state_dict()
    with make(1) as third:
        third.load_state_dict(state)
        rest = [records_of(b) for b in third]
    assert taken + rest == full


def test_the_state_counts_only_what_the_consumer_received():
    with make(2, batch_size=2, prefetch=4, ordered=False) as loader:
        it = iter(loader)
        taken = flat(records_of(next(it)) for _ in range(3))
        state = loader.state_dict()
        wait_until(lambda: loader.stats()["batches"] >= 8, what="the workers to run ahead of the consumer")
        assert loader.state_dict() == state
    lengths = dict(SHARDS)
    received = state["stream"]["received"] + [[s, 0, lengths[s]] for s in state["stream"]["complete"]]
    assert sorted(taken) == sorted(shard * 1000 + r for shard, start, stop in received for r in range(start, stop))


class RecordingFn:
    """fn that appends each record it runs on to a file (shared by every worker)."""

    def __init__(self, path):
        self.path = path

    def __call__(self, record):
        with open(self.path, "a") as f:
            f.write(f"{int(record['id'][0])}\n")
        return record


@pytest.mark.parametrize("ordered", [True, False])
def test_records_received_are_skipped_without_running_fn(tmp_path, ordered):
    log = tmp_path / "fn.log"
    with make(2, fn=RecordingFn(str(log)), ordered=ordered, batch_size=3) as first:
        it = iter(first)
        taken = flat(records_of(next(it)) for _ in range(4))
        state = first.state_dict()
    log.unlink()
    with make(2, fn=RecordingFn(str(log)), ordered=ordered, batch_size=3) as second:
        second.load_state_dict(state)
        rest = flat(records_of(b) for b in second)
    assert sorted(taken + rest) == ALL
    assert sorted(int(line) for line in log.read_text().split()) == sorted(rest)  # fn ran on the rest only


@pytest.mark.parametrize("ordered", [True, False])
def test_resume_in_every_batching_mode(ordered):
    modes = [dict(collate_fn=pad_collate, batch_size=3), dict(collate_fn=pad_collate, batch_size=3, drop_last=True),
             dict(batch_size=None), dict(drop_last=True), dict(shuffle=True, seed=4, batch_size=3)]
    for kwargs in modes:
        full = uninterrupted(ordered=ordered, **kwargs)
        for before, after, cut in ((2, 0, 2), (0, 2, 7)):
            taken, state, rest = interrupted(cut, before, after, ordered=ordered, **kwargs)
            got = flat(taken + rest)
            assert len(got) == len(set(got)), (kwargs, cut)
            if ordered:
                assert taken + rest == full, (kwargs, cut, state)
            elif not kwargs.get("drop_last"):  # (sloppy drop_last may leave out other records)
                assert sorted(got) == ALL, (kwargs, cut, state)


def test_resume_with_batch_fn_gives_the_same_batches():
    full = uninterrupted(batch_fn=summarize, batch_size=3)
    taken, _, rest = interrupted(2, 2, 0, batch_fn=summarize, batch_size=3)
    assert taken + rest == full


@pytest.mark.parametrize("ordered", [True, False])
def test_shuffle_buffer_resume_is_exactly_once(ordered):
    for before, after, cut in ((2, 0, 3), (0, 2, 9), (2, 2, 5)):
        taken, state, rest = interrupted(cut, before, after, ordered=ordered, shuffle_buffer=7, seed=3, batch_size=4)
        assert sorted(flat(taken + rest)) == ALL, (before, after, cut, state)
    # Records in the buffer at the cut were not received: the state has holes behind the stream's front.
    assert any(a > 0 for _, a, _ in state["stream"]["received"]) or len(state["stream"]["received"]) > 1


def test_a_sloppy_state_keeps_what_fast_shards_gave_while_a_slow_one_stalled(tmp_path):
    gate = str(tmp_path / "gate")
    shards = [("slow", 6, gate)] + [(f"fast{k}", 5, None) for k in range(3)]  # blocks of 3: 3 + 2 records
    safety = threading.Timer(60, lambda: open(gate, "w").close())  # only so that a failure cannot hang
    safety.start()
    try:
        with make(2, shards=shards, open_fn=gated_open, cycle_length=2, block_length=3, batch_size=3,
                  ordered=False, collate_fn=list) as first:
            it = iter(first)
            taken = [next(it) for _ in range(6)]  # every fast record; the slow shard stalls
            state = first.state_dict()
            open(gate, "w").close()
    finally:
        safety.cancel()
    assert sorted(r for b in taken for r in b) == sorted(f"fast{k}-{i}" for k in range(3) for i in range(5))
    assert state["stream"] == {"cursor": None, "complete": [1, 2, 3], "received": []}
    with make(0, shards=shards, open_fn=gated_open, cycle_length=2, block_length=3, batch_size=3,
              ordered=False, collate_fn=list) as second:
        second.load_state_dict(state)
        assert [r for b in second for r in b] == [f"slow-{i}" for i in range(6)]


# --------------------------------------------------------------------------- epochs
def by_epoch(pairs):
    out = {}
    for epoch, batch in pairs:
        out.setdefault(epoch, []).append(records_of(batch))
    return out


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("epochs", [2, None])
def test_resume_across_epochs(ordered, epochs):
    kwargs = dict(epochs=epochs, with_epoch=True, shuffle=True, seed=9, ordered=ordered)
    with make(2, **kwargs) as loader:
        full = by_epoch(b for _, b in zip(range(30), loader, strict=False))  # 14 batches an epoch
    for before, after, cut in ((2, 0, 10), (0, 2, 14), (2, 1, 17)):
        with make(before, **kwargs) as first:
            it = iter(first)
            taken = [next(it) for _ in range(cut)]
            state = json.loads(json.dumps(first.state_dict()))
        with make(after, **kwargs) as second:
            second.load_state_dict(state)
            rest = list(second) if epochs is not None else [b for _, b in zip(range(30 - cut), second, strict=False)]
        assert state["epoch"] == (0 if cut < 14 else 1) and state["until"] == (None if epochs is None else 2)
        got = by_epoch([(e, b) for e, b in taken + rest])
        for epoch in (0, 1):
            assert sorted(flat(got[epoch])) == ALL, (epoch, cut, state)
            if ordered:
                assert got[epoch] == full[epoch], (epoch, cut)


def test_state_before_and_between_epochs():
    with make(1) as loader:
        assert loader.state_dict()["stream"] is None and loader.state_dict()["epoch"] == 0
        first = [records_of(b) for b in loader]
        state = loader.state_dict()
    assert (state["epoch"], state["stream"], state["ahead"]) == (1, None, [])
    with make(0) as other:
        other.load_state_dict(state)
        assert [records_of(b) for b in other] == first  # epoch 1: same order (shuffle is off)
        assert other.epoch == 2


def test_an_ahead_entry_resumes_a_later_epoch_where_it_stood():
    # An unordered stream may return batches of epoch e+1 before the last ones of epoch e; the state
    # then holds both. Built here from two real states (epoch 0's, then epoch 1's).
    kwargs = dict(epochs=2, with_epoch=True, ordered=False)
    with make(2, **kwargs) as loader:
        it = iter(loader)
        taken = [next(it) for _ in range(17)]  # all of epoch 0 (14), 3 of epoch 1
        state1 = loader.state_dict()
    with make(2, **kwargs) as loader:
        it = iter(loader)
        taken0 = [next(it) for _ in range(4)]
        state0 = loader.state_dict()
    assert (state0["epoch"], state1["epoch"]) == (0, 1)
    state = dict(state0, ahead=[[1, state1["stream"]]])
    with make(0, **kwargs) as second:
        second.load_state_dict(state)
        assert second.state_dict() == state
        rest = list(second)
    got = by_epoch(taken0 + [p for p in taken if p[0] == 1] + rest)
    assert sorted(flat(got[0])) == ALL and sorted(flat(got[1])) == ALL


def test_an_endless_stream_without_workers_keeps_no_finished_epoch():
    # workers=0, epochs=None: the epochs the consumer is past are let go, as with workers (each
    # finished epoch used to stay in the stream: one more for every epoch, forever). The state
    # taken far into the stream is still right.
    shards, kwargs = [(0, 3), (1, 2)], dict(batch_size=2, epochs=None, with_epoch=True)  # 3 batches an epoch
    source = Shards(shards, open_shard, cycle_length=2, block_length=2)
    with Loader(source, workers=0, **kwargs) as loader:
        it = iter(loader)
        for epoch, batch in it:  # noqa: B007 -- the batch of epoch 60 it stops at is checked below
            if epoch == 60:
                break
        gc.collect()
        alive = [o for o in gc.get_objects()
                 if type(o) is Epoch and type(o.plan) is ShardPlan and o.plan.config.shards is source]
        assert len(alive) <= 2, sorted(e.number for e in alive)
        state = json.loads(json.dumps(loader.state_dict()))
        assert (state["epoch"], state["until"], state["ahead"]) == (60, None, [])
        rest_of_60 = [(e, records_of(b)) for e, b in (next(it) for _ in range(2))]
        after_60 = loader.state_dict()
        assert (after_60["epoch"], after_60["stream"]) == (61, None)
    with make(0, shards=shards, cycle_length=2, block_length=2, **kwargs) as second:
        second.load_state_dict(state)
        assert [(e, records_of(b)) for _, (e, b) in zip(range(2), second, strict=False)] == rest_of_60
    assert [e for e, _ in rest_of_60] == [60, 60]
    assert sorted(records_of(batch) + flat(r for _, r in rest_of_60)) == [0, 1, 2, 1000, 1001]


# --------------------------------------------------------------------------- refused states
def test_states_from_other_settings_or_sources_are_refused():
    with make(2) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    mismatches = [(dict(batch_size=4), "batch_size=5"), (dict(block_length=5), "block_length=4"),
                  (dict(cycle_length=2), "cycle_length=3"), (dict(collate_fn=pad_collate), "mode='stack'"),
                  (dict(shards=SHARDS[:-1]), "shards=9"), (dict(seed=1, shuffle=True), "shuffle=False")]
    for kwargs, named in mismatches:
        with make(0, **kwargs) as other, pytest.raises(ValueError, match=named):
            other.load_state_dict(state)
    with Loader(list(range(10)), batch_size=5, workers=0) as indexable:
        with pytest.raises(ValueError, match="saved by a loader over a streaming source"):
            indexable.load_state_dict(state)
        with make(0) as other, pytest.raises(ValueError, match="saved by a loader over an indexable source"):
            other.load_state_dict(indexable.state_dict())


@pytest.mark.parametrize("corrupt, named", [
    (lambda s: dict(s, stream={"cursor": None}), "keys cursor, complete and received"),
    (lambda s: dict(s, stream=dict(s["stream"], received=[[0, 3, 1]])), "received entry"),
    (lambda s: dict(s, stream=dict(s["stream"], received=[[0, 0, 2], [0, 2, 3]])), "received entry"),
    (lambda s: dict(s, stream=dict(s["stream"], complete=[99])), "complete shards"),
    (lambda s: dict(s, stream=dict(s["stream"], cursor=[0, 1, [[0, 0]]])), "cursor"),
    (lambda s: dict(s, stream=dict(s["stream"], cursor=[0, 1, [[5, 0], None, None]])), "cursor"),
    (lambda s: dict(s, ahead=[[1, None]]), "ahead entry"),
])
def test_corrupt_states_are_refused(corrupt, named):
    with make(0) as loader:
        next(iter(loader))
        state = loader.state_dict()
        with pytest.raises(ValueError, match=named):
            loader.load_state_dict(corrupt(state))
