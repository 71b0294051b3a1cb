"""Snapshots of an ``IterableDataset`` replica: what its state is, where it travels, how it comes back.

Used by ``procpipe.torch.iterable`` (the replicas, in the workers) and ``procpipe.torch.state``
(the facade's ``state_dict``). User docs: docs/guide/pytorch-resume.md.

A replica's *state*, taken in the process that iterates it, is torchdata's
``StatefulDataLoader`` worker state: ``dataset_state`` (the dataset's ``state_dict()`` if it
is ``Stateful`` and not its own iterator) and ``fetcher_state`` (``dataset_iter_state``: the
iterator's ``state_dict()`` if it is ``Stateful``; ``fetcher_ended``). A *snapshot* is such a
state with the replica's *position*: how many records (batches, errors, and the end marker)
it had produced when it was taken. Restoring one is torchdata's order: the dataset's state,
then a new iterator, then the iterator's state; the records between the snapshot and the
position wanted are produced again and dropped (the "fast-forward").

Snapshots travel two ways:

- **with the batches** (``Tagged``): every record a replica sends carries its worker and
  position, and every ``snapshot_every_n_steps``-th one (per replica) the snapshot taken
  just after it; the consumer keeps the last snapshot of each replica among the batches it
  returned (``procpipe.torch.state``), which is what ``state_dict()`` saves;
- **into a file** (``SnapshotStore``): the worker also writes its last few snapshots to a
  small file per replica, which outlives the process. When a worker dies, its replacement
  reopens the replica from the latest snapshot at or before the first batch not delivered,
  and produces again only what lies between: the replica goes on exactly once. A loaded
  ``state_dict`` is written there too, for the workers to resume from.
"""

from __future__ import annotations

import copy
import os
import pickle
import secrets
import shutil
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeGuard

from .._core import reaper

__all__ = ["ReplicaEnded", "SnapshotStore", "Tagged", "capture", "has_state", "is_stateful", "restore"]

KEEP = 8  # snapshots kept per replica in its file: more than the records one worker has in flight


class Stateful(Protocol):
    """torchdata's ``Stateful`` protocol, for type checkers (``is_stateful`` is the run-time check)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def is_stateful(obj: Any) -> TypeGuard[Stateful]:
    """torchdata's ``Stateful`` protocol: ``state_dict()`` and ``load_state_dict(state)``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def capture(dataset: Any, iterator: Any, ended: bool, private: bool = False) -> dict[str, Any]:
    """The replica's state now (``private``: deep-copied, for a state kept in this process)."""
    dataset_state = dataset.state_dict() if is_stateful(dataset) and iterator is not dataset else None
    iter_state = iterator.state_dict() if iterator is not None and is_stateful(iterator) else None
    state = {
        "dataset_state": dataset_state,
        "fetcher_state": {"dataset_iter_state": iter_state, "fetcher_ended": bool(ended)},
    }
    return copy.deepcopy(state) if private else state


def has_state(state: dict[str, Any] | None) -> bool:
    """Whether ``state`` restores anything (else a resume re-reads from the epoch's start)."""
    if not state:
        return False
    fetcher = state.get("fetcher_state") or {}
    return state.get("dataset_state") is not None or fetcher.get("dataset_iter_state") is not None


def restore(dataset: Any, state: dict[str, Any], open_iter: Callable[[Any], Iterator]) -> Iterator:
    """A new iterator of ``dataset`` at ``state`` (torchdata's order: dataset, iterator, its state)."""
    if state.get("dataset_state") is not None and is_stateful(dataset):
        dataset.load_state_dict(state["dataset_state"])
    iterator = open_iter(dataset)
    iter_state = (state.get("fetcher_state") or {}).get("dataset_iter_state")
    if iter_state is not None and is_stateful(iterator):
        iterator.load_state_dict(iter_state)
    return iterator


class ReplicaEnded:
    """The value of a replica's last record: it has ended (its ``Tagged`` holds the final state)."""

    __slots__ = ()

    def __reduce__(self) -> Any:
        return ReplicaEnded, ()


class Tagged:
    """A replica's record as the consumer receives it: ``value`` (a packed batch, a
    ``RaisedInReplica``, or ``ReplicaEnded``), the replica (``_worker``), its ``position``,
    and a snapshot (``snap_position``, ``state``: the replica's state, dill-pickled) or ``state=None``."""

    __slots__ = ("position", "snap_position", "state", "value", "worker")

    def __init__(
        self, value: Any, worker: int, position: int, snap_position: int = -1, state: bytes | None = None
    ) -> None:
        self.value = value
        self.worker = worker
        self.position = position
        self.snap_position = snap_position
        self.state = state

    def __reduce__(self) -> Any:
        return Tagged, (self.value, self.worker, self.position, self.snap_position, self.state)


class SnapshotStore:
    """A directory with one file per replica: its last ``KEEP`` snapshots ``(epoch, position, state)``.

    Made by the facade for a loader's workers (``create``), written by the worker iterating
    the replica (only it writes that file; ``os.replace`` makes each write atomic, so a
    process dying mid-write leaves the previous list), read by its replacement.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def create(cls, parent: str) -> SnapshotStore:
        """A new, private (0700) directory under ``parent`` (the loader's ``shm_dir``), named as
        procpipe names what it leaves there (``procpipe-<pid>-<8 hex>-replicas``): registered with
        this process's reaper and locked while it exists, so that the reaper removes it if the
        process is killed, and a later process's start-up sweep if the reaper could not
        (_core/reaper.py, _core/stale_files.py)."""
        while True:
            path = os.path.join(parent, f"procpipe-{os.getpid()}-{secrets.token_hex(4)}-replicas")
            reaper.register(path)
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                reaper.forget(path)  # (someone else's: never ours to remove)
                continue
            except BaseException:
                reaper.forget(path)
                raise
            break
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            reaper.hold(path, fd)  # locked at once: the sweep never takes it for a dead process's
        finally:
            os.close(fd)
        return cls(path)

    def _file(self, worker: int) -> str:
        return os.path.join(self.path, f"replica-{int(worker)}.pkl")

    def read(self, worker: int) -> list[tuple[int, int, dict | None]]:
        """Replica ``_worker``'s snapshots, oldest first (empty if none was written)."""
        try:
            with open(self._file(worker), "rb") as f:
                return pickle.load(f)
        except (FileNotFoundError, EOFError, pickle.UnpicklingError):
            return []

    def write(self, worker: int, snapshots: Sequence[tuple[int, int, dict | None]]) -> None:
        """Replace replica ``_worker``'s snapshots (the last ``KEEP``)."""
        target = self._file(worker)
        tmp = f"{target}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                pickle.dump(snapshots[-KEEP:], f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, target)
        except FileNotFoundError:  # the DataLoader was closed (its directory removed) while this worker ran
            pass

    def best(self, worker: int, epoch: int, position: int) -> tuple[int, dict] | None:
        """The latest snapshot of ``_worker``'s replica in ``epoch`` at or before ``position``."""
        found = None
        for e, p, state in self.read(worker):
            if state is None:  # (the mark of a replica opened without a state: mark_opened)
                continue
            if e == epoch and p <= position and (found is None or p >= found[0]):
                found = (p, state)
        return found

    def initial(self, worker: int, epoch: int) -> tuple[bool, dict | None]:
        """Whether replica ``worker`` has started ``epoch`` (opened its iterator, or failed in
        ``worker_init_fn``), and its state then (None: it has none)."""
        for e, p, state in self.read(worker):
            if e == epoch and p == 0:
                return True, state
        return False, None

    def remove(self) -> None:
        """Delete the directory and its files (the loader is closed)."""
        shutil.rmtree(self.path, ignore_errors=True)  # a worker still writing finds it gone (write())
        reaper.forget(self.path)
