"""``IterableDataset`` support for ``procpipe.torch.DataLoader``: one replica per worker.

``import procpipe`` never imports this module; ``procpipe.torch`` uses it for a dataset that
is a ``torch.utils.data.IterableDataset``. User docs: README.md, section "PyTorch:
procpipe.torch.DataLoader", subsection "IterableDataset".

torch's semantics, and how they are kept:

- **A replica per worker.** Each worker iterates its own copy of the dataset with
  ``torch.utils.data.get_worker_info()`` set (id, num_workers, seed, dataset), so the
  dataset's own sharding code decides what each worker yields. Here a replica is one
  more kind of streaming source: ``Replicas`` is a ``procpipe.Shards`` whose shard ``w``
  is "replica ``w``", bound to worker ``w`` (``worker_for``); a task is a ``Block`` of
  one record, "the next batch of replica ``w``", and the worker keeps the replica's
  iterator open between tasks (the streaming engine's shard affinity). Everything else is
  the streaming engine's: dispatch, ring slots, worker restarts, ordered/sloppy delivery.
- **Batches are made in the worker** (``BatchFetcher``: ``batch_size`` samples from the
  iterator, ``collate_fn``; ``drop_last`` drops each worker's short last batch; with
  ``batch_size=None`` each sample goes through ``collate_fn`` alone), then packed by the
  facade (its arrays and tensors travel through the ring slot, not pickled).
- **Order.** ``in_order=True``: torch hands tasks to workers round-robin and returns
  them in that order, skipping a worker once its replica has ended. That is the
  streaming engine's ordered interleave with ``cycle_length=num_workers`` and one batch
  per block, exactly. ``in_order=False``: batches as they arrive.
- **Errors** raised by ``worker_init_fn``, ``__iter__``, the iterator's ``__next__`` or
  ``collate_fn`` travel as a record (``RaisedInReplica``) in the batch's place, and the
  consumer re-raises them there, with the worker and the batch position named; the
  loader goes on (as torch's does), the replica with its next batch (after an error in
  ``worker_init_fn`` or ``__iter__``, which leave no iterator, the replica has ended).
- **Seeds**: torch's, per worker: ``base_seed + id`` for ``random`` and torch,
  ``_generate_state(base_seed, id)`` for numpy, once per worker process (when it first
  opens its replica, before ``worker_init_fn`` and ``__iter__``); ``base_seed`` is drawn from the
  loader's ``generator`` as torch draws it, so the replicas see the same random numbers as under
  torch's DataLoader.
- **State** (``procpipe.torch.snapshots``): every record carries its replica and position,
  and every ``snapshot_every``-th one the replica's state (torchdata's ``Stateful``
  protocol: the dataset's and its iterator's ``state_dict()``), which the facade's
  ``state_dict()`` saves; each replica's records end with a ``ReplicaEnded`` one, carrying
  its final state (the consumer drops it).
- **A worker crash** is recovered exactly when the replica is ``Stateful``: the worker also
  writes its last snapshots to shared memory (``SnapshotStore``), and the replacement process
  restores the latest one at or before the first record not received and produces again
  only the records between (``Replicas.open``). An opaque iterator cannot be re-read from
  where the dead worker was: then the epoch fails with ``ReplicaLostError`` naming the
  worker. (A replica that had delivered nothing this epoch is started again in the
  replacement process; that loses and repeats nothing.)

``num_workers=0`` iterates the dataset in the calling process (``BatchFetcher`` directly,
no replica, ``get_worker_info()`` is None), as torch does.

An ``IterDataPipe`` gets what torch's DataLoader gives it: a shared seed for its random
pipes (``apply_random_seed``: every replica shuffles alike, so ``sharding_filter`` after
``shuffle`` splits one order), and sharding by worker (and rank) through the wrapped
``worker_init_fn``; in the calling process ``in_process`` does both. With persistent
workers, torch sends each later epoch's shared seed to its workers; procpipe's replicas
derive it from the first one and the epoch (``epoch_seed``): the same for every replica,
not torch's value.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import dill
import numpy as np
import torch
from torch.utils.data import default_collate

from .. import Shards
from .._ext import Block, add_note
from ..errors import RemoteTraceback, WorkerError
from .snapshots import ReplicaEnded, SnapshotStore, Tagged, capture, has_state, restore
from .state_schema import FETCHER_ENDED, FETCHER_STATE, ReplicaState
from .worker_setup import become_torch_worker

__all__ = [
    "BatchFetcher",
    "RaisedInReplica",
    "ReplicaLostError",
    "ReplicaSpec",
    "Replicas",
    "epoch_seed",
    "in_process",
    "reraise",
    "sharding_init",
]


class ReplicaLostError(WorkerError):
    """A worker died while iterating its replica of an ``IterableDataset``: the epoch cannot
    go on without losing or repeating that replica's data (its iterator cannot be resumed in
    another process)."""


class BatchFetcher:
    """Batches from one iterator of a dataset, one per ``next()``, as torch's fetcher makes them.

    ``batch_size`` samples (fewer at the end; none or, with ``drop_last``, fewer ends it)
    through ``collate_fn``; ``batch_size=None``: each sample through ``collate_fn`` alone.
    An exception from the iterator or ``collate_fn`` propagates and leaves the fetcher
    usable: the next call asks the iterator again (a finished generator then ends).
    """

    def __init__(
        self, iterator: Iterator[Any], batch_size: int | None, drop_last: bool, collate_fn: Callable[[Any], Any]
    ) -> None:
        self.iterator = iterator
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.ended = False

    def __iter__(self) -> BatchFetcher:
        return self

    def __next__(self) -> Any:
        if self.ended:
            raise StopIteration
        if self.batch_size is None:
            return self.collate_fn(next(self.iterator))
        samples = []
        for _ in range(self.batch_size):
            try:
                samples.append(next(self.iterator))
            except StopIteration:
                self.ended = True
                break
        if not samples or (self.drop_last and len(samples) < self.batch_size):
            self.ended = True
            raise StopIteration
        return self.collate_fn(samples)


class RaisedInReplica(NamedTuple):
    """An exception raised in a replica, travelling in the place of the batch it cost."""

    exc_bytes: bytes | None  # the exception, dill-pickled (None: it does not pickle)
    type_name: str
    message: str
    traceback: str
    worker: int
    position: int  # the replica's batch number in the epoch
    stage: str  # "worker_init_fn", "__iter__", or "__next__ or collate_fn"


def reraise(raised: RaisedInReplica) -> NoReturn:
    """Raise what a replica raised, with its original type when it unpickles (else
    ``WorkerError``), its traceback as ``__cause__`` and a note naming where."""
    exc: Any = None
    if raised.exc_bytes is not None:
        try:
            exc = dill.loads(raised.exc_bytes)
        except Exception:  # noqa: BLE001 - any unpickling failure: fall back to the text
            exc = None
    if not isinstance(exc, BaseException):
        exc = WorkerError(f"{raised.type_name}: {raised.message}")
    add_note(
        exc,
        f"procpipe: raised in {raised.stage} of the IterableDataset replica of worker {raised.worker}, "
        f"at its batch {raised.position} of this epoch; the worker's traceback is shown above.",
    )
    where = f"in {raised.stage} of the IterableDataset replica of worker {raised.worker}"
    headline = RemoteTraceback.headline_of(raised.type_name, raised.message, where)
    raise exc from RemoteTraceback(raised.traceback, headline)


def _raised(exc: BaseException, worker: int, position: int, stage: str) -> RaisedInReplica:
    try:
        exc_bytes = dill.dumps(exc, protocol=dill.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - unpicklable: the consumer gets a WorkerError with the text
        exc_bytes = None
    return RaisedInReplica(
        exc_bytes,
        f"{type(exc).__module__}.{type(exc).__qualname__}",
        str(exc),
        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        worker,
        position,
        stage,
    )


@dataclass
class ReplicaSpec:
    """What every worker's replica needs (shipped to the workers with the source)."""

    dataset: Any
    num_workers: int
    base_seed: int  # torch's: drawn from the loader's generator when the workers start
    worker_init_fn: Callable[[int], Any] | None
    batch_size: int | None  # None: no automatic batching
    drop_last: bool
    collate_fn: Callable[[Any], Any]
    pack: Callable[[Any], Any]  # a batch (or a RaisedInReplica) -> what travels through the ring
    shared_seed: int | None = None  # an IterDataPipe's shared seed (of ``first_epoch``); None: not a datapipe
    first_epoch: int = 0  # the loader's epoch number of the first epoch these workers load
    snapshot_every: int = 1  # a replica's state with every n-th record (0: only the first and the last)
    store: SnapshotStore | None = None  # the snapshots in shared memory (a replacement process resumes from them)
    resume_epoch: int | None = None  # a loaded state_dict's epoch: its replicas may re-read from the start
    resume_positions: dict[int, int] | None = None  # ... up to these positions (those without a snapshot)


def epoch_seed(shared_seed: int, epoch: int) -> int:
    """The shared seed of a later epoch of persistent replicas: the same in every replica."""
    return int(np.random.SeedSequence([shared_seed & (2**64 - 1), epoch]).generate_state(1, np.uint64)[0] >> 1)


def _seeded(datapipe: Any, shared_seed: int) -> Any:
    from torch.utils.data.graph_settings import apply_random_seed

    return apply_random_seed(datapipe, torch.Generator().manual_seed(shared_seed))


def in_process(dataset: Any, shared_seed: int | None) -> Any:
    """The dataset as the calling process iterates it (``num_workers=0``): an
    ``IterDataPipe`` (``shared_seed`` not None) seeded and sharded by rank, as torch does."""
    if shared_seed is None:
        return dataset
    from torch.utils.data.dataloader import _get_distributed_settings  # private: torch's own rank lookup
    from torch.utils.data.graph_settings import apply_sharding

    dataset = _seeded(dataset, shared_seed)
    apply_sharding(dataset, *_get_distributed_settings())
    return dataset


def sharding_init(worker_init_fn: Callable[[int], Any] | None) -> Callable[[int], Any]:
    """An ``IterDataPipe``'s ``worker_init_fn``: torch's sharding by worker and rank, then the user's."""
    from torch.utils.data.dataloader import _get_distributed_settings, _sharding_worker_init_fn  # private

    return functools.partial(_sharding_worker_init_fn, worker_init_fn, *_get_distributed_settings())


def _in_private_memory(collate_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """torch's ``default_collate`` as the replica runs it: into private memory.

    In a worker (``get_worker_info()`` set) ``default_collate`` stacks into a new
    shared-memory segment, for torch's queue to pass on; here the batch is copied into
    the ring anyway, and a segment per batch costs more than the stacking (measured:
    bench/torch_iterable.py, images). Another ``collate_fn`` runs as it is.
    """
    return _PrivateDefaultCollate() if collate_fn is default_collate else collate_fn


class _PrivateDefaultCollate:
    """``default_collate`` with ``get_worker_info()`` None while it runs (see ``_in_private_memory``)."""

    def __call__(self, batch: Any) -> Any:
        from torch.utils.data._utils import worker as _torch_worker  # private: the variable get_worker_info reads

        info, _torch_worker._worker_info = _torch_worker._worker_info, None
        try:
            return default_collate(batch)
        finally:
            _torch_worker._worker_info = info


class _ReplicaBatches:
    """One epoch of a replica, in its worker: the records ``Shards`` reads, each a packed
    ``Tagged`` (a batch, a ``RaisedInReplica`` in the place of a batch that failed, or the
    final ``ReplicaEnded``), with the replica's snapshots (``procpipe.torch.snapshots``).

    ``start``: ``(position, state)`` to restore the replica at (records before it are not
    produced: ``Shards`` skips them); a state of an ended replica at position 0 is carried
    over (the previous epoch's end, ``persistent_workers``): restored, then a new iterator.
    """

    def __init__(
        self,
        replica: Replicas,
        worker: int,
        init_error: RaisedInReplica | None,
        start: tuple[int, ReplicaState] | None = None,
    ) -> None:
        self.replica = replica
        self.worker = worker
        self.fetcher: BatchFetcher | None = None
        self.iterator: Any = None
        self.position = 0
        self.done = False
        self.ended = False  # the ReplicaEnded record was sent
        self.init_error = init_error  # worker_init_fn raised: the first record, then the end
        self.start_state: ReplicaState | None
        self.skip_to, self.start_state = start if start is not None else (0, None)
        self.initial: tuple[int, bytes] | None = None  # the snapshot at the epoch's start, sent with record 0

    def __iter__(self) -> _ReplicaBatches:
        return self

    def _open(self) -> BatchFetcher:
        spec, state = self.replica.spec, self.start_state
        if state is None:
            self.iterator = iter(spec.dataset)
        else:
            self.iterator = restore(spec.dataset, state, iter)
            if state[FETCHER_STATE].get(FETCHER_ENDED):
                if self.skip_to == 0:  # the previous epoch's end, carried over: this epoch's iterator
                    self.iterator = iter(spec.dataset)
                else:
                    self.ended = True  # restored after its end: nothing more
        self.fetcher = BatchFetcher(self.iterator, spec.batch_size, spec.drop_last, _in_private_memory(spec.collate_fn))
        if self.position == 0:
            self.initial = self._snapshot(0, False)
            if self.initial is None:
                self.replica.mark_opened(self.worker)  # (a stateless replica: state_dict() need not wait)
        return self.fetcher

    def _snapshot(self, position: int, ended: bool) -> tuple[int, bytes] | None:
        """The replica's state at ``position`` (pickled), also written to the store; None if stateless."""
        state = capture(self.replica.spec.dataset, self.iterator, ended)
        if not has_state(state):
            return None
        self.replica.keep_snapshot(self.worker, position, state)
        return position, dill.dumps(state, protocol=dill.HIGHEST_PROTOCOL)

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        if self.position < self.skip_to:  # before the restored snapshot: never delivered, never produced
            self.position += 1
            return None
        spec = self.replica.spec
        if self.init_error is not None:
            self.replica.mark_opened(self.worker)
            error, self.init_error, self.done = self.init_error, None, True
            self.position += 1
            return spec.pack(Tagged(error, self.worker, self.position - 1))
        stage = "__next__ or collate_fn"
        snapshot = None
        try:
            fetcher = self.fetcher
            if fetcher is None:
                stage = "__iter__"
                fetcher = self._open()
                stage = "__next__ or collate_fn"
            if self.ended:
                raise StopIteration
            batch = next(fetcher)
        except StopIteration:
            if self.ended or self.fetcher is None:
                self.close()
                raise
            self.ended = True
            batch = ReplicaEnded()
            snapshot = self._snapshot(self.position + 1, True)
        except Exception as exc:  # noqa: BLE001 - the user's error goes to the consumer as a record (as torch's)
            if self.fetcher is None:
                self.done = True  # no iterator: the replica has nothing more this epoch
            batch = _raised(exc, self.worker, self.position, stage)
        self.position += 1
        every = spec.snapshot_every
        if snapshot is None and every and self.position % every == 0 and self.fetcher is not None:
            snapshot = self._snapshot(self.position, False)
        if snapshot is None and self.initial is not None:
            snapshot = self.initial
        self.initial = None
        snap_position, state = snapshot if snapshot is not None else (-1, None)
        try:
            return spec.pack(Tagged(batch, self.worker, self.position - 1, snap_position, state))
        except Exception as exc:  # noqa: BLE001 - e.g. collate_fn returned something that does not pickle
            error = _raised(exc, self.worker, self.position - 1, "packing the batch collate_fn returned")
            return spec.pack(Tagged(error, self.worker, self.position - 1, snap_position, state))

    def close(self) -> None:
        """Let the dataset's iterator go (a new epoch replaces it, as torch's does)."""
        self.done = True
        self.fetcher = None
        self.iterator = None


class Replicas(Shards):
    """A streaming source of ``num_workers`` shards: shard ``w`` is worker ``w``'s replica.

    The loader's copy (the one its ``ShardProducer`` holds and reads through ``open_shard``
    and ``reading``; never the facade's own object), in each worker process, binds itself to
    the first replica it opens (its worker's, as ``worker_for`` asks): it sets ``get_worker_info()``, seeds the
    generators and runs ``worker_init_fn`` then, once per process; each epoch opens a
    new iterator over the same dataset object (so with ``persistent_workers`` what the
    replica keeps in its attributes persists across epochs, as with torch).
    """

    replayable = False  # a replica's iterator lives in its worker only (see reopening)

    def __init__(self, spec: ReplicaSpec) -> None:
        super().__init__(list(range(spec.num_workers)), self.open, cycle_length=spec.num_workers, block_length=1)
        self.spec = spec
        self._worker: int | None = None  # the replica this process iterates (set when bound)
        self._init_error: RaisedInReplica | None = None
        self._current: _ReplicaBatches | None = None
        self._epoch = spec.first_epoch  # the epoch of the block being read (reading)
        self._reopen_at = 0  # reopening(): the record the next open() must resume at
        # this process's replica's last snapshots (the store's): (epoch, position, state)
        self._snapshots: list[tuple[int, int, ReplicaState]] = []

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_current"] = None
        state["_snapshots"] = []
        return state

    def worker_for(self, shard: int) -> int | None:
        return shard

    def open_shard(self, shard: int) -> _ReplicaBatches:
        return self.open(self.shards[shard])  # (this object: the loader's copy, in the worker's process)

    def reading(self, epoch: int) -> None:
        self._epoch = epoch  # (open needs it: an IterDataPipe's shared seed is per epoch)

    def reopening(self, block: Block) -> None:
        self._reopen_at = block.first  # open() resumes there, from a snapshot (or refuses)

    def keep_snapshot(self, worker: int, position: int, state: ReplicaState) -> None:
        """Write a snapshot of this process's replica to the store (for a replacement process)."""
        store = self.spec.store
        if store is None:
            return
        self._snapshots.append((self._epoch, position, state))
        del self._snapshots[:-8]
        store.write(worker, self._snapshots)

    def mark_opened(self, worker: int) -> None:
        """Tell the store this epoch's replica has started without a state to save (its initial
        snapshot, where it has one, says so itself): the facade's ``state_dict()`` waits for either."""
        store = self.spec.store
        if store is not None:
            store.write(worker, [*self._snapshots, (self._epoch, 0, None)])

    def _start(self, worker: int) -> tuple[int, ReplicaState] | None:
        """Where this epoch's replica starts: a snapshot to restore, or None (its start)."""
        first, self._reopen_at = self._reopen_at, 0
        spec = self.spec
        found = None if spec.store is None else spec.store.best(worker, self._epoch, first)
        if found is not None or first == 0:
            return found
        if spec.resume_epoch == self._epoch and (spec.resume_positions or {}).get(worker) == first:
            return None  # a loaded state without a snapshot: re-read from the start (torchdata's fast-forward)
        raise ReplicaLostError(
            f"procpipe.torch: the IterableDataset replica of worker {worker} was lost after it had "
            f"delivered {first} batch(es) of this epoch: the worker's process died and procpipe started "
            "a replacement, but neither the dataset nor its iterator is Stateful (state_dict() and "
            "load_state_dict()), so the replica cannot be resumed in another process and the epoch cannot go "
            "on without losing or repeating its data. Give the dataset or its iterator state_dict() / "
            "load_state_dict() (the replacement then resumes from its last snapshot, exactly once), find why "
            "the worker died (the out-of-memory killer, a crash in native code, os._exit or sys.exit in the "
            "dataset), or make the dataset map-style (__getitem__)."
        )

    def open(self, worker: int) -> _ReplicaBatches:
        """This epoch's iterator of replica ``_worker`` (in the worker's process)."""
        if self._worker is None:
            self._bind(worker)
        elif self._worker != worker:
            raise ReplicaLostError(
                f"procpipe.torch: the IterableDataset replica of worker {worker} was sent to the process of "
                f"worker {self._worker} (worker {worker}'s process died); a replica cannot move to another "
                "worker's process, which already iterates its own."
            )
        if self._current is not None:
            self._current.close()  # the previous epoch's iterator, if it was not read to its end
        spec = self.spec
        if spec.shared_seed is not None:  # an IterDataPipe: its random pipes seeded alike in every replica
            seed = spec.shared_seed if self._epoch == spec.first_epoch else epoch_seed(spec.shared_seed, self._epoch)
            spec.dataset = _seeded(spec.dataset, seed)
        self._current = _ReplicaBatches(self, worker, self._init_error, self._start(worker))
        self._init_error = None
        return self._current

    def _bind(self, worker: int) -> None:
        """Set this process up as torch sets up worker ``_worker``."""
        spec = self.spec
        self._worker = worker
        become_torch_worker(spec.base_seed, worker, spec.num_workers, spec.dataset)
        if spec.worker_init_fn is not None:
            try:
                spec.worker_init_fn(worker)
            except Exception as exc:  # noqa: BLE001 - sent to the consumer as the replica's first record
                self._init_error = _raised(exc, worker, 0, "worker_init_fn")
