"""``state_dict()`` / ``load_state_dict()`` of ``procpipe.torch.DataLoader``: torchdata's
``StatefulDataLoader`` contract, built on procpipe's positions.

User docs: docs/guide/pytorch-resume.md. One ``FacadeState`` per DataLoader; the facade calls
it at fixed points of an iteration (``begin``, ``before_draw``, ``resume_loader``,
``received``, ``finished``) and it composes the state from:

- **procpipe's position** (``Loader.state_dict()``): which batches of the epoch were
  returned, exact whatever ``num_workers``, ``in_order`` or prefetching did (for an
  ``IterableDataset`` with workers: how many records of each replica);
- **the sampler's draw**, for a map-style dataset: the epoch's sampler items are drawn in
  this process when the epoch starts, so the state keeps what that draw depends on (the
  states of the generators it may use, ``Stateful`` samplers' states), and a resumed epoch
  draws them again identically; procpipe's position then skips the batches returned;
- **the ``Stateful`` objects' states**: the dataset's (``num_workers=0``: taken here, as
  torchdata does), and each ``IterableDataset`` replica's (dataset and iterator, taken in
  its worker: ``procpipe.torch.snapshots``);
- **the seeds**: per-sample seed, the epoch's ``base_seed`` (and an ``IterDataPipe``'s shared
  seed), and between epochs the generator the next epoch draws from.

The state is laid out as torchdata's (``_snapshot`` / ``_worker_snapshots`` / ``worker_<i>``
with ``dataset_state`` and ``fetcher_state``; with ``num_workers=0``, ``dataset_state`` and
``fetcher_state`` at the top), plus a ``procpipe`` entry holding the rest. It is JSON
serializable when the user's states are (generator states are base64 text). Every key is a
constant of ``procpipe.torch.state_schema``, and each part a ``TypedDict`` there (``SavedState``,
``FacadeEntry``, ``Draw``, ``ReplicaState``...): this module reads and writes through them.
"""

from __future__ import annotations

import base64
import copy
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any, cast

import dill
import torch

from .._ext import DONE, DONE_BELOW, EPOCH, ended_epoch
from .draws import generators_of
from .iterable import BatchFetcher
from .snapshots import ReplicaEnded, SnapshotStore, Tagged, capture, has_state, is_stateful, restore
from .state_schema import (
    BASE_SEED,
    DATASET_ITER_STATE,
    DATASET_STATE,
    DRAW,
    FETCHER_ENDED,
    FETCHER_STATE,
    FINISHED,
    GENERATORS,
    IN_PROCESS,
    ITERABLE,
    ITERATOR_FINISHED,
    LOADER,
    MAIN_BASE_SEED,
    MAIN_NUM_WORKERS,
    MAIN_SNAPSHOT,
    NUM_WORKERS,
    PROCPIPE,
    REPLICAS,
    SAMPLERS,
    SAVED,
    SEED,
    SHARED_SEED,
    SNAPSHOT,
    START_STATE,
    VERSION,
    VERSION_KEY,
    WORKER_ID,
    WORKER_SNAPSHOTS,
    WORKER_STATES,
    YIELDED,
    Draw,
    FacadeEntry,
    FetcherState,
    LoadedEntry,
    ReplicaStart,
    ReplicaState,
    SavedState,
    WorkerSnapshot,
    replica_key,
    worker_key,
    worker_of_key,
)
from .state_schema import EPOCH as ENTRY_EPOCH  # the facade entry's (EPOCH: the Loader position's)

__all__ = ["FacadeState", "InProcessReplica", "on_moved", "on_value"]

INITIAL_STATE_WAIT_S = 60.0  # state_dict() before a replica's first batch: how long it waits for its start


def on_value(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` applied to a ``Tagged`` record's batch (pinning), or to the batch itself."""

    def apply(x: Any) -> Any:
        if type(x) is Tagged:
            x.value = fn(x.value)
            return x
        return fn(x)

    return apply


def on_moved(transfer: Callable[..., tuple[Any, Any]], convert: Callable[[Any], Any]) -> Callable[..., tuple[Any, Any]]:
    """The device stage's copy of a batch (``CudaTransfer``), for a ``Tagged`` record: its batch
    is moved, its tag goes on to the consumer (``received``)."""

    def move(batch: Any, position: Any) -> tuple[Any, Any]:
        tags: list[Tagged] = []

        def unwrap(x: Any) -> Any:
            value = convert(x)
            if type(value) is Tagged:
                tags.append(value)
                return value.value
            return value

        moved, ready = transfer(batch, unwrap, position)
        if tags:
            tags[0].value = moved
            return tags[0], ready
        return moved, ready

    return move


def _batches_returned(position: dict[str, Any] | None) -> int:
    """The batches of its epoch a saved position (a map-style dataset's: indexed) says were returned:
    those below ``done_below`` and those in ``done`` (no key of its own: the format stays 0.1.0's)."""
    if not position:
        return 0
    return int(position.get(DONE_BELOW) or 0) + len(position.get(DONE) or ())


def _encode_rng(generator: torch.Generator) -> str:
    return base64.b64encode(generator.get_state().numpy().tobytes()).decode("ascii")


def _decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _samplers(index_sampler: Any) -> list[Any]:
    """The ``Stateful`` samplers (the batch sampler, and the sampler inside it)."""
    return [
        obj for obj in (index_sampler, getattr(index_sampler, "sampler", None)) if obj is not None and is_stateful(obj)
    ]


def _decoded(state: Any) -> Any:
    """A replica state as received (dill bytes from a worker) or loaded (an object): a private copy."""
    return dill.loads(state) if isinstance(state, bytes) else copy.deepcopy(state)


class InProcessReplica:
    """An ``IterableDataset`` iterated in this process (``num_workers=0``): batches as torch's
    fetcher makes them, counted, with its state at any moment (torchdata's single-process state).

    ``start``: a saved ``ReplicaStart`` (``{"state", "yielded"}``) to resume at: the state
    restored (torchdata's order), or without one the first ``yielded`` batches made again and
    dropped; an ended state is carried over (restored, then a new iterator: the epoch after it).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None,
        drop_last: bool,
        collate_fn: Callable,
        start: ReplicaStart | None,
        carry: bool = False,
    ) -> None:
        self.dataset = dataset
        self.yielded = 0
        state = None if start is None else start.get(START_STATE)
        if start is not None and state is not None and has_state(state):
            self.iterator = restore(dataset, state, iter)
            ended = bool(state[FETCHER_STATE].get(FETCHER_ENDED))
            if ended and carry:  # the previous epoch's end: this epoch's iterator
                self.iterator = iter(dataset)
            else:
                self.yielded = int(start.get(YIELDED, 0))
        else:
            ended = False
            self.iterator = iter(dataset)
        self.fetcher = BatchFetcher(self.iterator, batch_size, drop_last, collate_fn)
        self.fetcher.ended = ended and not carry
        skip = 0 if start is None or (state is not None and has_state(state)) else int(start.get(YIELDED, 0))
        if skip:
            warnings.warn(
                f"procpipe.torch.DataLoader: neither the IterableDataset nor its iterator is Stateful: "
                f"resuming makes its first {skip} batches again and drops them",
                stacklevel=4,
            )
            for _ in range(skip):
                next(self.fetcher)
            self.yielded = skip

    def __iter__(self) -> InProcessReplica:
        return self

    def __next__(self) -> Any:
        batch = next(self.fetcher)
        self.yielded += 1
        return batch

    def state(self) -> ReplicaState:
        return capture(self.dataset, self.iterator, self.fetcher.ended, private=True)


class FacadeState:
    """The state of one ``procpipe.torch.DataLoader``: kept during its iterations, saved and loaded."""

    def __init__(
        self,
        *,
        dataset: Any,
        iterable: bool,
        num_workers: int,
        persistent: bool,
        generator: torch.Generator | None,
        snapshot_every: int,
        index_sampler: Any = None,
    ) -> None:
        self.dataset = dataset
        self.index_sampler = index_sampler
        self.iterable = iterable
        self.num_workers = num_workers
        self.persistent = persistent
        self.generator = generator
        self.snapshot_every = snapshot_every
        self.store: SnapshotStore | None = None
        self.stores: list[SnapshotStore] = []  # the store, for cleanup() (which must not hold this object)
        self.pending: LoadedEntry | None = None  # a loaded state's entry, for the next iteration
        self.fresh = False  # nothing iterated since the load: state_dict() gives the loaded state back
        self.epoch = 0  # the epoch of the current (or next) iteration
        self.started = False
        self.done = False  # the current iteration ended (StopIteration)
        self.seeds: tuple[int | None, int | None] = (None, None)  # base_seed, shared_seed
        self.draws: dict[int, Draw] = {}  # epoch -> what its sampler draw depends on
        # The iteration's procpipe Loader and stage, held weakly: the Loader's coordinator thread reaches
        # this object (through the sampler), so a strong reference would keep the Loader forever.
        self.loader: weakref.ref | None = None
        self.stage: weakref.ref | None = None
        self.batches = 0  # len() of the iteration's Loader
        self.frozen: dict[str, Any] | None = None  # its position, kept when it closed (closing())
        self.replica: InProcessReplica | None = None
        self.delivered: dict[int, int] = {}  # replica -> records returned (incl. errors and its end)
        self.snaps: dict[int, tuple[int, Any]] = {}  # replica -> (position, state) of its last snapshot returned
        self.ended: set[int] = set()
        # a Stateful map-style dataset with workers: worker -> its dataset's state (dill bytes, or as
        # loaded) after the last batch it made that was returned (sampling.SnapshottingCollate)
        self.worker_snaps: dict[int, Any] = {}
        self.seed = 0  # the per-sample seed, as of the last state_dict()
        self.returned = 0  # batches the iteration returned (with a resumed epoch's before it)

    def reconfigure(self, num_workers: int, generator: torch.Generator | None, index_sampler: Any) -> None:
        """The DataLoader's attributes were assigned after construction (``num_workers``, ``generator``)."""
        self.num_workers, self.generator, self.index_sampler = num_workers, generator, index_sampler

    # ---------------------------------------------------------------- checks
    @staticmethod
    def check_every(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"snapshot_every_n_steps must be an int >= 0 (0: a replica's state only at the start "
                f"and the end of its epoch), got {value!r}"
            )
        return value

    # ---------------------------------------------------------------- the iteration
    def begin(self, epoch: int, base_seed: int, shared_seed: int | None) -> tuple[int, int | None]:
        """A new iteration (epoch ``epoch``) starts, with these freshly drawn seeds; returns the
        seeds it uses (a resumed epoch's are the saved ones)."""
        pending = self.pending
        if (
            pending is not None
            and (saved_seed := pending.get(BASE_SEED)) is not None
            and (pending[ENTRY_EPOCH] == epoch or (pending[FINISHED] and self.persistent and self.num_workers))
        ):
            base_seed, shared_seed = saved_seed, pending.get(SHARED_SEED)  # the saved workers' seeds
        self.epoch, self.started, self.done = epoch, True, False
        self.seeds = (base_seed, shared_seed)
        self.loader = self.stage = self.replica = self.frozen = None
        self.delivered, self.snaps, self.ended = {}, {}, set()
        self.returned = 0
        if pending is not None and pending[ENTRY_EPOCH] == epoch and not pending[FINISHED]:
            self.returned = _batches_returned(pending.get(LOADER))
        if not self.iterable:
            if self._resumes_workers(epoch):
                self.worker_snaps = dict(pending[WORKER_STATES]) if pending is not None else {}
            elif not self.persistent:
                self.worker_snaps = {}  # fresh workers: their initial states
        if pending is not None and pending[ENTRY_EPOCH] == epoch:
            for key, (delivered, position, state) in (pending.get(REPLICAS) or {}).items():
                worker = int(key)
                self.delivered[worker] = delivered
                if state is not None:
                    self.snaps[worker] = (position, state)
                if state is not None and state.get(FETCHER_STATE, {}).get(FETCHER_ENDED) and position > 0:
                    self.ended.add(worker)
        self.fresh = False
        for old in [e for e in self.draws if e < epoch]:
            del self.draws[old]
        return base_seed, shared_seed

    def before_draw(self, index_sampler: Any) -> None:
        """The iteration's sampler items are about to be drawn: for a resumed epoch, put back
        what the original draw depended on; then remember it (for a state taken in this epoch)."""
        pending, epoch = self.pending, self.epoch
        generators = generators_of(index_sampler, self.generator)
        if pending is not None and pending[ENTRY_EPOCH] == epoch and pending.get(DRAW) is not None:
            draw = pending[DRAW]
            # (strict=False: the draw was saved by a DataLoader built the same way; zip's shortest wins)
            for g, text in zip(generators, draw[GENERATORS], strict=False):
                g.set_state(_decode_rng(text))
            for obj, state in zip(_samplers(index_sampler), draw[SAMPLERS], strict=False):
                obj.load_state_dict(copy.deepcopy(state))
        self.draws[epoch] = {
            GENERATORS: [_encode_rng(g) for g in generators],
            SAMPLERS: [copy.deepcopy(obj.state_dict()) for obj in _samplers(index_sampler)],
        }

    def _resumes_workers(self, epoch: int) -> bool:
        """Whether epoch ``epoch``'s workers start from a loaded state's worker snapshots: those of its
        own epoch, or with persistent workers the epoch after a finished one (the same workers went on)."""
        pending = self.pending
        if pending is None or not pending.get(WORKER_STATES):
            return False
        if pending[FINISHED]:
            return self.persistent and pending[ENTRY_EPOCH] + 1 == epoch
        return pending[ENTRY_EPOCH] == epoch

    def worker_states(self, epoch: int) -> dict[int, bytes]:
        """The map-style workers' dataset states for a new loader starting at ``epoch`` (``TorchSource``)."""
        if not self._resumes_workers(epoch):
            return {}
        assert self.pending is not None
        states = self.pending[WORKER_STATES]
        return {
            w: dill.dumps(state, protocol=dill.HIGHEST_PROTOCOL)
            for w, state in states.items()
            if w < self.num_workers and state is not None
        }

    def replica_options(self, epoch: int) -> dict[str, Any]:
        """``ReplicaSpec`` fields for a new loader's replicas (workers), starting at ``epoch``; writes
        the snapshots a loaded state resumes them from into the store."""
        if self.store is None or self.store.replicas < self.num_workers:  # (num_workers may be assigned later)
            self.store = SnapshotStore.create(self.num_workers)
            self.stores.append(self.store)
        options: dict[str, Any] = {"snapshot_every": self.snapshot_every, "store": self.store}
        pending = self.pending
        if pending is None:
            return options
        for key, (_delivered, position, state) in (pending.get(REPLICAS) or {}).items():
            if state is not None:
                start = pending[ENTRY_EPOCH] if not pending[FINISHED] else pending[ENTRY_EPOCH] + 1
                self.store.write(int(key), [(start, 0 if pending[FINISHED] else position, _decoded(state))])
        if not pending[FINISHED]:
            options["resume_epoch"] = pending[ENTRY_EPOCH]
            # (v[0]: the records of the replica returned, "delivered")
            options["resume_positions"] = {int(k): v[0] for k, v in (pending.get(REPLICAS) or {}).items()}
        return options

    def resume_loader(self, loader: Any, stage: Any) -> None:
        """The iteration's procpipe Loader (before ``iter()``): a resumed epoch's position is loaded into it."""
        self.loader, self.stage = weakref.ref(loader), None
        self.batches = 0 if self.iterable else len(loader)  # (a stream's Loader has no len())
        pending = self.pending
        if pending is not None and pending[ENTRY_EPOCH] == self.epoch and pending.get(LOADER) is not None:
            loader.load_state_dict(pending[LOADER])

    def set_stage(self, stage: Any) -> None:
        self.stage = None if stage is None else weakref.ref(stage)

    def closing(self) -> None:
        """The iteration ends or is dropped (its Loader may close): keep its position."""
        if not self.done:
            self.frozen = self._position()

    def _position(self) -> dict[str, Any] | None:
        """The procpipe Loader's state, with the position of the stage's last batch (if a stage holds some ahead)."""
        loader = None if self.loader is None else self.loader()
        if loader is None:
            return self.frozen
        state = loader.state_dict()
        stage = None if self.stage is None else self.stage()
        if stage is not None and callable(getattr(stage, "get_state", None)):
            try:
                state = {**state, **stage.get_state()}
            except TypeError:
                pass
        return state

    def in_process(
        self, dataset: Any, batch_size: int | None, drop_last: bool, collate_fn: Callable
    ) -> InProcessReplica:
        """The iteration's ``IterableDataset`` in this process (``num_workers=0``), resumed if loaded so."""
        pending = self.pending
        start: ReplicaStart | None = None
        if pending is not None and pending[ENTRY_EPOCH] == self.epoch:
            start = {START_STATE: pending.get(IN_PROCESS), YIELDED: pending.get(YIELDED, 0)}
        elif pending is not None and pending[FINISHED] and pending[ENTRY_EPOCH] + 1 == self.epoch:
            start = {START_STATE: pending.get(IN_PROCESS), YIELDED: 0}
        self.replica = InProcessReplica(
            dataset, batch_size, drop_last, collate_fn, start, carry=pending is not None and pending[FINISHED]
        )
        return self.replica

    def started_iteration(self) -> None:
        """The iteration is set up: a loaded state has been used."""
        if (
            self.pending is not None
            and self.pending[FINISHED] is False
            and self.pending[ENTRY_EPOCH] == self.epoch
            and self.num_workers == 0
            and not self.iterable
            and self.pending.get(DATASET_STATE) is not None
            and is_stateful(self.dataset)
        ):
            self.dataset.load_state_dict(copy.deepcopy(self.pending[DATASET_STATE]))
        self.pending = None

    def received(self, record: Any) -> Any:
        """A record of a replica, returned by the consumer: its batch (``ReplicaEnded``: the replica ended)."""
        self.returned += 1
        if type(record) is not Tagged:
            return record
        worker = record.worker
        if not self.iterable:  # a map-style batch with its worker's dataset state
            if record.state is not None:
                self.worker_snaps[worker] = record.state
            return record.value
        self.delivered[worker] = record.position + 1
        if record.state is not None:
            self.snaps[worker] = (record.snap_position, record.state)
        if type(record.value) is ReplicaEnded:
            self.ended.add(worker)
        return record.value

    def finished(self) -> None:
        self.done = True

    # ---------------------------------------------------------------- saving and loading
    def _ended_state(self) -> SavedState:
        done, self.done = self.done, True
        try:
            return self.state_dict(self.seed)
        finally:
            self.done = done

    def state_dict(self, seed: int) -> SavedState:
        """The state (see the module docstring; its keys and types: ``procpipe.torch.state_schema``)."""
        if self.fresh and self.pending is not None:
            return copy.deepcopy(self.pending[SAVED])
        self.seed = seed
        finished = self.started and self.done
        mine: FacadeEntry = {
            VERSION_KEY: VERSION,
            ENTRY_EPOCH: self.epoch,
            FINISHED: finished,
            SEED: seed,
            NUM_WORKERS: self.num_workers,
            ITERABLE: self.iterable,
            BASE_SEED: self.seeds[0],
            SHARED_SEED: self.seeds[1],
        }
        if finished or not self.started:  # the next epoch draws from the generator as it is now
            mine[GENERATORS] = [_encode_rng(g) for g in generators_of(self.index_sampler, self.generator)]
            mine[SAMPLERS] = [copy.deepcopy(obj.state_dict()) for obj in _samplers(self.index_sampler)]
        elif self.started and (loader_state := self._position()) is not None:
            if loader_state.get(EPOCH, self.epoch) > self.epoch:  # every batch returned, not yet StopIteration
                if self.iterable:  # resumed as an ended epoch (the empty rest of this one is not replayed)
                    return self._ended_state()
                loader_state = dict(ended_epoch(loader_state, self.epoch, self.batches))
            mine[LOADER] = loader_state
        if not self.iterable and not finished and self.epoch in self.draws:
            mine[DRAW] = self.draws[self.epoch]
        state: SavedState = {}
        if self.num_workers == 0:
            dataset_state: Any = None
            fetcher_state: FetcherState | None = None
            if self.iterable and self.replica is not None:
                full = self.replica.state()
                dataset_state, fetcher_state = full[DATASET_STATE], full[FETCHER_STATE]
                mine[IN_PROCESS] = copy.deepcopy(full)
                mine[YIELDED] = self.replica.yielded
            elif not self.iterable and is_stateful(self.dataset):
                dataset_state = copy.deepcopy(self.dataset.state_dict())
            state = {
                DATASET_STATE: dataset_state,
                FETCHER_STATE: fetcher_state,
                ITERATOR_FINISHED: finished,
            }
        else:
            if self.iterable and self.started and not finished:
                self._await_initial_states()
            workers: dict[str, WorkerSnapshot] = {}
            replicas: dict[str, list[Any]] = {}
            for w in range(self.num_workers):
                snapshot: WorkerSnapshot = {
                    WORKER_ID: w,
                    DATASET_STATE: None,
                    FETCHER_STATE: None,
                }
                if not self.iterable and self.worker_snaps.get(w) is not None:
                    snapshot[DATASET_STATE] = _decoded(self.worker_snaps[w])
                if self.iterable:
                    position, saved = self.snaps.get(w, (0, None))
                    decoded = _decoded(saved) if saved is not None else None  # a ReplicaState, or None
                    if decoded is not None:
                        snapshot.update(decoded)
                    else:
                        snapshot[FETCHER_STATE] = {DATASET_ITER_STATE: None, FETCHER_ENDED: False}
                    # (set just above: a replica's state has a fetcher state)
                    cast(FetcherState, snapshot[FETCHER_STATE])[FETCHER_ENDED] = w in self.ended
                    replicas[replica_key(w)] = [self.delivered.get(w, 0), position, decoded]
                workers[worker_key(w)] = snapshot
            if self.iterable:
                mine[REPLICAS] = replicas
            state = {
                SNAPSHOT: {
                    WORKER_SNAPSHOTS: workers,
                    MAIN_SNAPSHOT: {
                        MAIN_NUM_WORKERS: self.num_workers,
                        MAIN_BASE_SEED: self.seeds[0],
                        ITERATOR_FINISHED: finished,
                    },
                }
            }
        state[PROCPIPE] = mine
        return state

    def _await_initial_states(self) -> None:
        """torchdata's iterator waits until every worker has sent its initial state; procpipe's replicas
        send theirs with their first batch. For a state taken before a replica's first batch came back,
        wait (up to ``INITIAL_STATE_WAIT_S``) until the replica has started and written its initial
        snapshot to the store, so the state holds it (what ``__iter__`` did to the replica counts)."""
        store = self.store
        waiting = [w for w in range(self.num_workers) if w not in self.snaps and not self.delivered.get(w)]
        if store is None or not waiting:
            return
        deadline = time.monotonic() + INITIAL_STATE_WAIT_S
        pause = 0.001
        while waiting:
            for w in list(waiting):
                started, state = store.initial(w, self.epoch)
                if started:
                    waiting.remove(w)
                    if state is not None and w not in self.snaps:
                        self.snaps[w] = (0, state)
            running = self.loader() if self.loader is not None else None
            if not waiting or running is None or time.monotonic() > deadline:
                return  # (an iteration let go closed its workers: they start no more)
            time.sleep(pause)  # the workers write the store's shared memory: no descriptor to wait on (bounded, rare)
            pause = min(pause * 2, 0.05)

    def load(self, state: Any) -> int:
        """Check a saved state and keep it for the next iteration; returns that iteration's epoch."""
        mine = state.get(PROCPIPE) if isinstance(state, dict) else None
        if not isinstance(mine, dict) or mine.get(VERSION_KEY) != VERSION:
            raise ValueError(
                f"not a procpipe.torch.DataLoader state (from DataLoader.state_dict()): {str(state)[:200]}"
            )
        if bool(mine.get(ITERABLE)) != self.iterable:
            kinds = ("a map-style dataset", "an IterableDataset")
            raise ValueError(
                f"this state was saved by a DataLoader over {kinds[bool(mine.get(ITERABLE))]}, but this "
                f"one reads {kinds[self.iterable]}; resume with a DataLoader built the same way"
            )
        if self.iterable and mine.get(NUM_WORKERS) != self.num_workers:
            raise ValueError(
                f"this state was saved by a DataLoader with num_workers={mine.get(NUM_WORKERS)}, but this one "
                f"has num_workers={self.num_workers}: an IterableDataset has one replica per worker, each with its own "
                "state, so it resumes with the same num_workers (a map-style dataset resumes with any)"
            )
        # (checked as far as a resume needs; the rest is trusted to be a state_dict()'s, of this version)
        pending = cast(LoadedEntry, copy.deepcopy(mine))
        pending[SAVED] = copy.deepcopy(state)
        if self.num_workers == 0 and not self.iterable:
            pending[DATASET_STATE] = state.get(DATASET_STATE)
        if not self.iterable:  # the workers' dataset states (torchdata's worker snapshots)
            workers = (state.get(SNAPSHOT) or {}).get(WORKER_SNAPSHOTS) or {}
            pending[WORKER_STATES] = {
                worker_of_key(key): copy.deepcopy(snap.get(DATASET_STATE))
                for key, snap in workers.items()
                if isinstance(snap, dict) and snap.get(DATASET_STATE) is not None
            }
        if pending[FINISHED] or pending.get(GENERATORS) is not None:  # before the next epoch's draws
            if pending.get(DATASET_STATE) is not None and is_stateful(self.dataset):
                self.dataset.load_state_dict(copy.deepcopy(pending[DATASET_STATE]))
            # (strict=False: a state without these lists, or of a DataLoader built otherwise, restores what matches)
            for g, text in zip(
                generators_of(self.index_sampler, self.generator), pending.get(GENERATORS) or (), strict=False
            ):
                g.set_state(_decode_rng(text))
            for obj, saved in zip(_samplers(self.index_sampler), pending.get(SAMPLERS) or (), strict=False):
                obj.load_state_dict(copy.deepcopy(saved))
            if not (self.persistent or self.num_workers == 0):
                pending[REPLICAS] = {}  # fresh replicas each epoch: nothing carries over
        self.pending = pending
        self.fresh = True
        self.started = False
        return pending[ENTRY_EPOCH] + 1 if pending[FINISHED] else pending[ENTRY_EPOCH]

    def close(self) -> None:
        """Release the snapshots' shared memory."""
        self.store = None
        self.cleanup(self.stores)

    @staticmethod
    def cleanup(stores: list[SnapshotStore]) -> None:
        """Remove ``stores`` (the DataLoader's finalizer: it holds the list, not the state, which
        holds the running Loader and must be collectable with the DataLoader)."""
        while stores:
            stores.pop().remove()
