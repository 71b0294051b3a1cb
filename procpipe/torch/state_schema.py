"""The keys and shapes of ``procpipe.torch.DataLoader``'s saved state, in one place: named constants
for every key, and ``TypedDict`` classes for what is stored under them, so that mypy checks each
read and write (``procpipe.torch.state`` builds and loads the state through them;
``procpipe.torch.snapshots`` and ``procpipe.torch.iterable`` take and restore a replica's state).

Two parts, two owners:

- **torchdata's layout** (``StatefulDataLoader.state_dict()``): ``_snapshot`` /
  ``_worker_snapshots`` / ``worker_<i>`` (each ``worker_id``, ``dataset_state``,
  ``fetcher_state``) and ``_main_snapshot`` with workers; ``dataset_state``, ``fetcher_state`` and
  ``_iterator_finished`` at the top with ``num_workers=0``. These strings are torchdata's, kept
  exactly, so that a ``StatefulDataLoader`` state and ours read the same way (the ``Stateful``
  states sit where torchdata puts them).
- **the facade's entry** (``procpipe``): ours, versioned by ``VERSION``; it holds what torchdata's
  layout cannot say (procpipe's position, the sampler's draw, the seeds, each replica's progress).

The values must never change: saved states written by older versions must keep loading
(``tests/data/states_v1/torch_*.json``, checked key for key by ``tests/test_saved_states.py``). A
key added to the entry is optional (``total=False``): an older state lacks it.
"""

from __future__ import annotations

from typing import Any, Final, TypedDict

__all__ = [
    "BASE_SEED",
    "DATASET_ITER_STATE",
    "DATASET_STATE",
    "DRAW",
    "EPOCH",
    "FETCHER_ENDED",
    "FETCHER_STATE",
    "FINISHED",
    "GENERATORS",
    "IN_PROCESS",
    "ITERABLE",
    "ITERATOR_FINISHED",
    "LOADER",
    "MAIN_BASE_SEED",
    "MAIN_NUM_WORKERS",
    "MAIN_SNAPSHOT",
    "NUM_WORKERS",
    "PROCPIPE",
    "REPLICAS",
    "SAMPLERS",
    "SAVED",
    "SEED",
    "SHARED_SEED",
    "SNAPSHOT",
    "START_STATE",
    "VERSION",
    "VERSION_KEY",
    "WORKER_ID",
    "WORKER_SNAPSHOTS",
    "WORKER_STATES",
    "YIELDED",
    "Draw",
    "FacadeEntry",
    "FetcherState",
    "LoadedEntry",
    "MainSnapshot",
    "ReplicaStart",
    "ReplicaState",
    "SavedState",
    "Snapshot",
    "WorkerSnapshot",
    "replica_key",
    "worker_key",
    "worker_of_key",
]

# --------------------------------------------------------------------------- torchdata's layout
# (``Final``: mypy reads each as its literal string, so a TypedDict access through it is checked)

#: with workers, the whole state but the facade's entry: ``Snapshot``
SNAPSHOT: Final = "_snapshot"
#: in ``SNAPSHOT``: ``worker_key(i)`` -> that worker's ``WorkerSnapshot``
WORKER_SNAPSHOTS: Final = "_worker_snapshots"
#: in ``SNAPSHOT``: the main process's part (``MainSnapshot``)
MAIN_SNAPSHOT: Final = "_main_snapshot"
#: in ``MAIN_SNAPSHOT``: the number of workers the state was taken with
MAIN_NUM_WORKERS: Final = "_num_workers"
#: in ``MAIN_SNAPSHOT``: the epoch's ``base_seed`` (the workers' seeds derive from it)
MAIN_BASE_SEED: Final = "_base_seed"
#: the epoch's iterator ended (StopIteration): in ``MAIN_SNAPSHOT``, or at the top with ``num_workers=0``
ITERATOR_FINISHED: Final = "_iterator_finished"
#: in a ``WorkerSnapshot``: the worker's index
WORKER_ID: Final = "worker_id"
#: the dataset's ``state_dict()`` (None: not ``Stateful``): in a worker snapshot, a replica's state,
#: at the top with ``num_workers=0`` (and in a ``LoadedEntry``, that top-level one of a map-style dataset)
DATASET_STATE: Final = "dataset_state"
#: the fetcher's part (``FetcherState``; None for a map-style dataset): beside ``DATASET_STATE``
FETCHER_STATE: Final = "fetcher_state"
#: in ``FETCHER_STATE``: the dataset iterator's ``state_dict()`` (None: not ``Stateful``)
DATASET_ITER_STATE: Final = "dataset_iter_state"
#: in ``FETCHER_STATE``: the replica's iterator was exhausted
FETCHER_ENDED: Final = "fetcher_ended"

_WORKER_PREFIX: Final = "worker_"


def worker_key(worker: int) -> str:
    """Worker ``worker``'s key in ``WORKER_SNAPSHOTS``: ``worker_<i>``."""
    return f"{_WORKER_PREFIX}{worker}"


def worker_of_key(key: str) -> int:
    """The worker a ``WORKER_SNAPSHOTS`` key names (``worker_key``'s inverse)."""
    return int(key.rsplit("_", maxsplit=1)[-1])


class FetcherState(TypedDict):
    """torchdata's fetcher state: the iterator's state and whether it ended."""

    dataset_iter_state: Any  # the iterator's state_dict(), or None
    fetcher_ended: bool


class ReplicaState(TypedDict):
    """An ``IterableDataset`` replica's state (``snapshots.capture``): torchdata's worker state."""

    dataset_state: Any  # the dataset's state_dict() (not its own iterator), or None
    fetcher_state: FetcherState


class WorkerSnapshot(TypedDict):
    """One worker's entry in ``WORKER_SNAPSHOTS``: an ``IterableDataset`` replica's state (``ReplicaState``,
    its ``fetcher_ended`` the replica's end as returned), or a map-style worker's dataset state."""

    worker_id: int
    dataset_state: Any  # the dataset's state_dict(), or None
    fetcher_state: FetcherState | None  # None: a map-style dataset


class MainSnapshot(TypedDict):
    """torchdata's main-process snapshot (``MAIN_SNAPSHOT``)."""

    _num_workers: int
    _base_seed: int | None
    _iterator_finished: bool


class Snapshot(TypedDict):
    """torchdata's ``SNAPSHOT``, with workers."""

    _worker_snapshots: dict[str, WorkerSnapshot]  # worker_key(i) -> its snapshot
    _main_snapshot: MainSnapshot


# --------------------------------------------------------------------------- the facade's entry

#: the top-level key of the facade's own entry (``FacadeEntry``)
PROCPIPE: Final = "procpipe"
#: the entry's format, saved under ``VERSION_KEY``; a state of another version is refused
VERSION: Final = 1
#: the entry's format version (``VERSION``)
VERSION_KEY: Final = "version"
#: the epoch of the iteration the state was taken in (or of the next one, if none started)
EPOCH: Final = "epoch"
#: that iteration ended (StopIteration): a resume starts the next epoch
FINISHED: Final = "finished"
#: the per-sample seed (``seed_globals``' seeds derive from it)
SEED: Final = "seed"
#: the DataLoader's ``num_workers`` (an ``IterableDataset`` resumes only with the same)
NUM_WORKERS: Final = "num_workers"
#: whether the dataset is an ``IterableDataset`` (a state resumes only a DataLoader of the same kind)
ITERABLE: Final = "iterable"
#: the epoch's ``base_seed`` (the workers' seeds); None before the first iteration
BASE_SEED: Final = "base_seed"
#: the epoch's shared seed (an ``IterDataPipe``'s shuffling and sharding), or None
SHARED_SEED: Final = "shared_seed"
#: between epochs: the generators the next epoch's draw uses, as they are (base64 ``get_state()``)
GENERATORS: Final = "generators"
#: between epochs: the ``Stateful`` samplers' ``state_dict()`` (the batch sampler, its sampler)
SAMPLERS: Final = "samplers"
#: during an epoch: procpipe's position (``Loader.state_dict()``): which batches were returned
LOADER: Final = "loader"
#: during an epoch of a map-style dataset: what its sampler draw depended on (``Draw``)
DRAW: Final = "draw"
#: an ``IterableDataset`` with workers: ``replica_key(i)`` -> ``[delivered, position, state]`` (records
#: returned, the position of the last snapshot returned, that ``ReplicaState`` or None)
REPLICAS: Final = "replicas"
#: an ``IterableDataset`` with ``num_workers=0``: its ``ReplicaState`` (a private copy)
IN_PROCESS: Final = "in_process"
#: an ``IterableDataset`` with ``num_workers=0``: the batches it yielded this epoch (``ReplicaStart`` too)
YIELDED: Final = "yielded"

# only in a loaded entry, kept in memory until the next iteration (``LoadedEntry``; never saved)

#: the whole state as loaded (``state_dict()`` before an iteration gives it back)
SAVED: Final = "saved"
#: a map-style dataset's workers: worker -> its dataset's state (from ``WORKER_SNAPSHOTS``)
WORKER_STATES: Final = "worker_states"
#: in a ``ReplicaStart``: the state an in-process replica resumes from
START_STATE: Final = "state"


def replica_key(worker: int) -> str:
    """Replica ``worker``'s key in ``REPLICAS`` (JSON keys are text); ``int(key)`` reads it back."""
    return str(worker)


class Draw(TypedDict):
    """What an epoch's sampler draw depends on (``DRAW``), taken just before it."""

    generators: list[str]  # the generators it may use, base64 get_state()
    samplers: list[Any]  # the Stateful samplers' state_dict()


class _FacadeEntryAlways(TypedDict):
    """The keys every entry holds."""

    version: int
    epoch: int
    finished: bool
    seed: int
    num_workers: int
    iterable: bool
    base_seed: int | None
    shared_seed: int | None


class FacadeEntry(_FacadeEntryAlways, total=False):
    """The facade's own entry (``PROCPIPE``): the always-present keys, and those of the moment the
    state was taken (see each key's constant)."""

    generators: list[str]
    samplers: list[Any]
    loader: dict[str, Any]
    draw: Draw
    replicas: dict[str, list[Any]]  # replica_key(i) -> [delivered, position, ReplicaState | None]
    in_process: ReplicaState
    yielded: int


class LoadedEntry(FacadeEntry, total=False):
    """A loaded state's entry, kept for the next iteration (``FacadeState.pending``), with what the
    load found elsewhere in the state."""

    saved: SavedState
    dataset_state: Any  # num_workers=0, a map-style dataset: the top-level DATASET_STATE
    worker_states: dict[int, Any]  # a map-style dataset: worker -> its dataset's state


class SavedState(TypedDict, total=False):
    """The whole state (``FacadeState.state_dict()``): with ``num_workers=0``, ``DATASET_STATE``,
    ``FETCHER_STATE`` and ``ITERATOR_FINISHED`` at the top; with workers, ``SNAPSHOT``; and ``PROCPIPE``."""

    dataset_state: Any
    fetcher_state: FetcherState | None
    _iterator_finished: bool
    _snapshot: Snapshot
    procpipe: FacadeEntry


class ReplicaStart(TypedDict):
    """Where an in-process replica (``num_workers=0``) starts: a loaded state's (``START_STATE``) and the
    batches it had yielded (``YIELDED``). In memory only."""

    state: ReplicaState | None
    yielded: int
