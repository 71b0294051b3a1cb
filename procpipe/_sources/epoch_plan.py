"""Per-epoch plans: which tasks one epoch holds, and what their results become. Pure: no
processes, no threads, no ring, no engine.

A source kind gives, for each epoch, an ``EpochPlan``: an indexed source (``len`` +
``__getitem__``) an ``IndexPlan`` (_sources/indexed/index_plan.py: a fixed list of batches of indices), a
stream (``procpipe.Shards``) a ``ShardPlan`` (_sources/stream/shard_plan.py: blocks of shards,
interleaved, whose number is learnt as the shards end). The engine's ``Epoch``
(epochs.py) holds one and drives it the same way for both, from the coordinator thread
(workers) or from the consumer's (``workers=0``)::

    plan.offers(per_lane)       the tasks that may be sent now, best first (``Offer``)
    plan.take(offer, worker)    one of them is sent: its ``Work`` (a new one, or a retry)
    plan.lost(work)             its worker died before answering: run it again? (False:
                                nothing is left to read there, it is dropped)
    plan.completed(work, result) -> [Ready]   its result arrived (``Loaded``, a ``Failure``
                                or ``EMPTY``): the batches the consumer may have now, in order
    plan.complete               every batch of the epoch has been handed out
    plan.taken(position)        the consumer took a batch (consumer thread)
    plan.state()                what the consumer has had, as ``Loader.state_dict`` saves it

A ``Work`` is a task as the plan sees it: its key (dispatch order, and with the epoch
number the seed of its samples), its payload (a list of indices, or a ``_sources.stream.Block``;
both iterate the keys of the samples they may hold) and its lane: tasks of one lane
(a shard read sequentially) go to the worker that holds the lane, the plan remembering
which (``Offer.worker``); lane None is any worker. The engine never looks inside a
payload; a plan never sees a worker, only a worker's index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol


class EmptyBatch:
    """A result: a task every sample of which was skipped (``on_error="skip"``); never delivered."""


EMPTY = EmptyBatch


@dataclass
class Failure:
    """Queue item: the epoch ends with this exception, raised in the consumer.

    ``batch_only``: only one batch failed (its user code raised); it is delivered in that
    batch's place, raised by ``next()``, and the next ``next()`` goes on with the batches
    after it. Otherwise (a dead engine, a broken sampler, a skip budget overrun) the
    iteration ends with it.
    """

    exc: BaseException
    batch_only: bool = False


class Work:
    """One task of an epoch, as its plan describes it (a plain slotted class: one per batch)."""

    __slots__ = ("key", "lane", "payload")

    def __init__(self, key: int, payload: Any, lane: int | None = None) -> None:
        self.key = key  # dispatch order within the epoch (an indexed source: the batch's position)
        self.payload = payload  # what the worker reads: a list of indices, or a streaming.Block
        self.lane = lane  # tasks of one lane go to one worker (a shard kept open); None: any


class Offer(NamedTuple):
    """A task the plan would send now (``EpochPlan.offers``), best first.

    ``worker``: the index of the worker holding its lane (None: any, or the least loaded
    for a lane not held yet). ``urgent``: the epoch waits for it (the ordered interleave's
    next block): it goes past the bound on batches in flight, and through the pipe when no
    ring slot is free, so the order never deadlocks. ``retry``: a task whose worker died,
    run again (it keeps the ring slot of its lost attempt)."""

    rank: tuple
    lane: int | None = None
    worker: int | None = None
    urgent: bool = False
    retry: Work | None = None


class Loaded(NamedTuple):
    """A task's batch arrived: its reply's ``layout`` (collate.py), the ``lease`` on its ring
    slot (None: inline), and how many samples ``on_error="skip"`` left out."""

    layout: list
    lease: Any
    skipped: int


class Ready(NamedTuple):
    """What a result gave the consumer: the batch at ``position`` of the epoch (or a batch-only
    ``Failure`` in its place; a ``Failure`` that is not batch-only ends the epoch; ``EMPTY``:
    a position with nothing to deliver) and the ``samples`` in it."""

    position: int
    batch: Any
    samples: int = 0


_new_tuple = tuple.__new__


def loaded(layout: list, lease: Any, skipped: int) -> Loaded:
    """``Loaded(layout, lease, skipped)``, without NamedTuple's argument handling (once per batch,
    on the coordinator thread's hot path: 0.3 us instead of 0.7)."""
    return _new_tuple(Loaded, (layout, lease, skipped))


def ready(position: int, batch: Any, samples: int) -> Ready:
    """``Ready(position, batch, samples)``, built as ``loaded`` is (once per batch)."""
    return _new_tuple(Ready, (position, batch, samples))


class PositionFormat(Protocol):
    """How a kind writes an epoch's progress (what the consumer has had of it) in a saved state,
    and reads it back checked (``ValueError`` naming what is corrupt): the resumed epoch's under
    keys of its own, each later epoch's as the rest of an ``ahead`` entry (saved_state.py writes
    the rest of the state). Each kind's epoch plan names its format (``EpochPlan.positions``):
    ``IndexPositions`` (indexed/index_positions.py), ``StreamPositions``
    (stream/stream_positions.py)."""

    def empty(self) -> Any:
        """The progress of an epoch of which nothing was returned."""
        ...

    def write(self, done: Any) -> dict[str, Any]:
        """The resumed epoch's progress, as the saved state's keys."""
        ...

    def write_ahead(self, done: Any) -> list[Any]:
        """A later epoch's progress, as the rest of its ``[epoch, ...]`` entry of ``ahead``."""
        ...

    def read(self, order: Any, state: dict[str, Any], epoch: int) -> Any:
        """The resumed epoch's progress from a saved state, checked against ``order``."""
        ...

    def read_ahead(self, order: Any, epoch: int, rest: list[Any]) -> Any:
        """A later epoch's progress from the rest of its ``ahead`` entry, checked."""
        ...


class EpochPlan:
    """The contract every source kind's per-epoch plan implements (see the module docstring).

    Attributes the engine reads: ``ordered``,
    ``skips_tasks`` (``on_error="skip"`` may leave out a whole task that failed, e.g. its
    collation: True for batches of indices, False for blocks, whose shard cannot be read
    past the failure).
    """

    ordered: bool
    skips_tasks: bool = True
    positions: ClassVar[PositionFormat]  # how a saved state holds an epoch's progress

    # ---- dispatch
    @property
    def exhausted(self) -> bool:
        """No task will be offered that was never sent: the next epoch may open."""
        raise NotImplementedError

    def offers(self, per_lane: int) -> Sequence[Offer]:
        """The tasks that may be sent now, best first (``per_lane``: tasks a lane may have in flight)."""
        raise NotImplementedError

    def take(self, offer: Offer, worker: int) -> Work:
        """``offer`` goes to worker ``worker``: its ``Work`` (the lane is now that worker's)."""
        raise NotImplementedError

    def lost(self, work: Work) -> bool:
        """``work`` must run again (its worker died); False: nothing is left to do there."""
        raise NotImplementedError

    def lanes_held(self) -> dict[int, int]:
        """Worker index -> lanes it holds open (to give a new lane to the least loaded)."""
        return {}

    def rotate(self, workers: int) -> None:
        """``assign="round_robin"``: give the epoch's k-th task to worker ``k % workers``. A plan
        whose tasks have lanes of their own (shards read sequentially) keeps them: nothing."""

    def moved(self, work: Work, worker: int) -> None:
        """``work`` runs on worker ``worker`` too (speculation: the worker holding its lane
        straggles): the lane's later tasks go there, not to the straggler. No lanes: nothing."""

    def held(self) -> int:
        """Results received and held back for their turn (they count as in flight)."""
        return 0

    # ---- results
    def slot_bytes(self, work: Work, layout: list, nbytes: int, skipped: int) -> int | None:
        """The ring's slot size, from the first result (``nbytes`` laid out as ``layout``, less
        ``skipped`` samples): large enough for a full task; None: this one cannot tell."""
        raise NotImplementedError

    def completed(self, work: Work, result: Any) -> list[Ready]:
        """``work``'s result (``Loaded``, ``Failure`` or ``EMPTY``): what the consumer may have now."""
        raise NotImplementedError

    @property
    def complete(self) -> bool:
        """Every batch of the epoch has been handed out (``completed``)."""
        raise NotImplementedError

    def sample_total(self) -> int | None:
        """The epoch's samples (what a fractional ``max_skipped`` is a fraction of); None when
        not known in advance (then the fraction is of ``samples_seen()``, asked at each skip)."""
        raise NotImplementedError

    def samples_seen(self) -> int:
        """Samples read so far, the task being counted included (asked where ``sample_total`` is None)."""
        return self.sample_total() or 0

    def finish(self) -> None:
        """The epoch ended or was cancelled: let go of what is held (leases of waiting results)."""

    # ---- the consumer's side (consumer thread)
    def taken(self, position: int) -> None:
        """The consumer took the batch at ``position``."""
        raise NotImplementedError

    def state(self) -> Any:
        """What the consumer has had, in the form ``Loader.state_dict`` saves (and ``resumed`` takes)."""
        raise NotImplementedError

    def all_taken(self) -> bool:
        """The consumer has had every batch of the epoch."""
        raise NotImplementedError

    @classmethod
    def unopened_state(cls, resumed: Any) -> Any:
        """``state()`` of an epoch not opened yet: what a resume said of it, if anything."""
        raise NotImplementedError


class Order(Protocol):
    """What a Loader holds for its source, whatever its kind (``IndexOrder``, ``MixOrder``,
    ``CallerOrder``, ``ShardOrder``): the batches of each epoch (lists of indices; for a
    stream, the order its shards are read in), and how many there are (``TypeError`` where
    that is not known in advance). ``epoch_plan``: the ``EpochPlan`` of its epochs (``IndexPlan``,
    or a stream's ``ShardPlan``), which the engine's ``Iteration`` builds each epoch with."""

    @property
    def epoch_plan(self) -> Any: ...

    def __len__(self) -> int: ...

    def batches(self, epoch: int) -> Sequence[Any]: ...
