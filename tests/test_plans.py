"""The per-epoch plans, driven through their contract alone (``plan.base.EpochPlan``), with no
engine, no process and no thread: a small simulated engine sends offers to made-up workers,
finishes tasks in a random order, loses some (their worker "died") and lets the consumer
take batches, for both source kinds (``IndexPlan``, ``ShardPlan``) with the same code.

What must hold whatever the order of events: every sample is delivered exactly once; an
ordered plan delivers in the same order as an undisturbed run; a plan rebuilt from
``state()`` after the consumer took some batches delivers exactly the rest; a task is only
offered in its lane's worker once the lane has one; tasks are never offered twice at once
beyond ``per_lane``.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from procpipe._sources.indexed.index_plan import IndexPlan
from procpipe._sources.epoch_plan import EMPTY, EpochPlan, Failure, Loaded
from procpipe._worker.produce import produce
from procpipe._core.rng import SampleScope
from procpipe._sources.indexed.index_order import IndexOrder
from procpipe._sources.stream import Shards, ShardOrder
from procpipe._worker.index_producer import IndexProducer
from procpipe._worker.worker_spec import WorkerSpec

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)

WORKERS = 3
PER_LANE = 2


def open_shard(shard):
    first, count = shard
    return (np.int64(first + r) for r in range(count))


class Kind:
    """One source kind: how to make its epoch's plan, and run a task in this process."""

    def __init__(self, name: str, ordered: bool) -> None:
        self.name = name
        self.ordered = ordered
        if name == "indexed":
            self.source = np.arange(23, dtype=np.int64)
            self.config = IndexOrder(len(self.source), batch_size=4, shuffle=True, seed=3, drop_last=False)
            self.epoch_plan = IndexPlan
        else:
            shards = Shards([(0, 7), (100, 5), (200, 9), (300, 0), (400, 4)], open_shard, cycle_length=2,
                            block_length=3)
            self.config = ShardOrder(shards, batch_size=4, shuffle=True, seed=3, drop_last=False)
            self.source = shards
            self.epoch_plan = self.config.epoch_plan
        producer = IndexProducer(self.source) if name == "indexed" else self.config.producer
        self.spec = WorkerSpec(source=self.source, producer=producer, fn=None, collate_fn=None, batched=True, seed=0)
        self.scope = SampleScope(0)

    def plan(self, state=None) -> EpochPlan:
        return self.epoch_plan(self.config, 0, self.config.batches(0), self.ordered, state)

    def run(self, work):
        produced = produce(self.spec, self.scope, 0, work.payload, None, 0)
        return EMPTY if produced.layout is None else Loaded(produced.layout, None, 0)


def drive(kind: Kind, plan: EpochPlan, rng: np.random.Generator, lose: float, stop_after: int | None = None):
    """Run ``plan`` to its end (or until the consumer took ``stop_after`` batches): returns the
    batches taken, in the order the consumer took them, as lists of sample values."""
    in_flight, ready, taken = [], [], []
    held_by: dict[int, int] = {}  # lane -> the worker the plan gave it to
    while not (plan.complete and not ready):
        if stop_after is not None and len(taken) >= stop_after:
            break
        offers = plan.offers(PER_LANE)
        for offer in offers:
            if offer.lane is not None and offer.lane in held_by and offer.retry is None:
                assert offer.worker == held_by[offer.lane], "a lane's task offered away from its worker"
        lanes = [w.lane for w in in_flight if w.lane is not None]
        assert all(lanes.count(lane) <= PER_LANE for lane in lanes), "more than per_lane tasks in one lane"
        roll = rng.random()
        if offers and (not in_flight or roll < 0.5) and len(in_flight) < 6:
            offer = offers[0] if rng.random() < 0.5 else offers[rng.integers(len(offers))]
            worker = offer.worker if offer.worker is not None else int(rng.integers(WORKERS))
            work = plan.take(offer, worker)
            if work.lane is not None:
                held_by[work.lane] = worker
            in_flight.append(work)
        elif in_flight:
            work = in_flight.pop(int(rng.integers(len(in_flight))))
            if rng.random() < lose:
                plan.lost(work)  # offered again (or dropped: nothing left to read there)
                held_by.pop(work.lane, None)  # its worker is gone: the lane may move
                continue
            for position, batch, _samples in plan.completed(work, kind.run(work)):
                assert type(batch) is not Failure, batch
                if batch is not EMPTY:
                    ready.append((position, batch))
        elif ready:
            pass
        else:
            pytest.fail(f"the plan offers nothing, holds nothing in flight and is not complete ({kind.name})")
        while ready and rng.random() < 0.7:  # the consumer takes what was handed out, in that order
            position, batch = ready.pop(0)
            plan.taken(position)
            taken.append([int(x) for x in np.asarray(batch).ravel()])
            if stop_after is not None and len(taken) >= stop_after:
                break
    return taken


def flat(batches):
    return [x for b in batches for x in b]


@pytest.mark.parametrize("name", ["indexed", "shards"])
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "sloppy"])
@pytest.mark.parametrize("seed", range(4))
def test_a_plan_delivers_every_sample_once_whatever_the_order_of_results_and_losses(name, ordered, seed):
    kind = Kind(name, ordered)
    reference = flat(drive(kind, kind.plan(), np.random.default_rng(99), lose=0.0))
    assert sorted(reference) == sorted(set(reference)) and len(reference) == (23 if name == "indexed" else 25)
    got = flat(drive(kind, kind.plan(), np.random.default_rng(seed), lose=0.25))
    assert sorted(got) == sorted(reference)
    if ordered:
        assert got == reference


@pytest.mark.parametrize("name", ["indexed", "shards"])
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "sloppy"])
@pytest.mark.parametrize("seed", range(3))
def test_a_plan_rebuilt_from_its_state_delivers_exactly_the_rest(name, ordered, seed):
    kind = Kind(name, ordered)
    reference = flat(drive(kind, kind.plan(), np.random.default_rng(99), lose=0.0))
    for stop_after in (0, 1, 3, 5):
        rng = np.random.default_rng(seed)
        first = kind.plan()
        before = flat(drive(kind, first, rng, lose=0.2, stop_after=stop_after))
        state = first.state()
        if name == "indexed":  # as Loader.state_dict saves it: the positions
            state = frozenset(state)
        else:
            state = json.loads(json.dumps(state))
        first.finish()
        second = kind.plan(state)
        after = flat(drive(kind, second, rng, lose=0.2))
        assert sorted(before + after) == sorted(reference), (stop_after, state)
        if ordered and name == "indexed":
            assert before + after == reference
        assert second.all_taken()


def test_an_empty_epoch_is_complete_at_once():
    kind = Kind("shards", True)
    plan = kind.epoch_plan(kind.config, 0, [], True, None)
    assert plan.complete and plan.exhausted and not plan.offers(PER_LANE)
    index = IndexPlan(None, 0, [], False)
    assert index.complete and index.exhausted and not index.offers(PER_LANE)


def test_a_failed_block_ends_a_stream_epoch_but_a_failed_batch_does_not_end_an_indexed_one():
    shards = Kind("shards", True)
    plan = shards.plan()
    work = plan.take(plan.offers(PER_LANE)[0], 0)
    out = plan.completed(work, Failure(ValueError("bad record"), batch_only=True))
    assert [type(r.batch) for r in out] == [Failure] and not out[0].batch.batch_only
    assert not plan.offers(PER_LANE)  # the shard cannot be read past it: nothing more is offered

    indexed = Kind("indexed", True)
    plan = indexed.plan()
    work = plan.take(plan.offers(PER_LANE)[0], 0)
    out = plan.completed(work, Failure(ValueError("bad sample"), batch_only=True))
    assert [(r.position, r.batch.batch_only) for r in out] == [(0, True)]
    assert plan.offers(PER_LANE)  # the next batches still go


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "sloppy"])
def test_a_fresh_plan_says_nothing_was_taken(ordered):
    """A fresh epoch (given no state, or the empty set of positions an indexed resume would
    give) has nothing to save: ``Loader.state_dict`` right after ``iter()`` must not claim a
    stream position (an empty interleave cursor would pin a resumed run's order)."""
    shards = Kind("shards", ordered)
    for fresh in (None, frozenset()):
        assert shards.plan(fresh).state() is None
    indexed = Kind("indexed", ordered)
    assert len(indexed.plan(frozenset()).state()) == 0
