"""Snapshots of an ``IterableDataset`` replica: what its state is, where it travels, how it comes back.

Used by ``procpipe.torch.iterable`` (the replicas, in the workers) and ``procpipe.torch.state``
(the facade's ``state_dict``). User docs: docs/guide/pytorch-resume.md.

A replica's *state*, taken in the process that iterates it, is torchdata's
``StatefulDataLoader`` worker state: ``dataset_state`` (the dataset's ``state_dict()`` if it
is ``Stateful`` and not its own iterator) and ``fetcher_state`` (``dataset_iter_state``: the
iterator's ``state_dict()`` if it is ``Stateful``; ``fetcher_ended``): ``ReplicaState`` of
``procpipe.torch.state_schema``, which holds the keys. A *snapshot* is such a state with the
replica's *position*: how many records (batches, errors, and the end marker) it had produced
when it was taken. Restoring one is torchdata's order: the dataset's state, then a new
iterator, then the iterator's state; the records between the snapshot and the
position wanted are produced again and dropped (the "fast-forward").

Snapshots travel two ways:

- **with the batches** (``Tagged``): every record a replica sends carries its worker and
  position, and every ``snapshot_every_n_steps``-th one (per replica) the snapshot taken
  just after it; the consumer keeps the last snapshot of each replica among the batches it
  returned (``procpipe.torch.state``), which is what ``state_dict()`` saves;
- **into shared memory** (``SnapshotStore``): the worker also writes its last few snapshots to a
  small segment of anonymous shared memory per replica (_core/shm.py), which outlives the
  process (the training process holds it, and sends it to each worker). When a worker dies, its replacement
  reopens the replica from the latest snapshot at or before the first batch not delivered,
  and produces again only what lies between: the replica goes on exactly once. A loaded
  ``state_dict`` is written there too, for the workers to resume from.
"""

from __future__ import annotations

import copy
import os
import pickle
import secrets
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeGuard

from .._ext import SharedFd, close_fd, new_memory
from .state_schema import DATASET_ITER_STATE, DATASET_STATE, FETCHER_ENDED, FETCHER_STATE, ReplicaState

__all__ = ["ReplicaEnded", "SnapshotStore", "Tagged", "capture", "has_state", "is_stateful", "restore"]

KEEP = 8  # snapshots kept per replica in its file: more than the records one worker has in flight


class Stateful(Protocol):
    """torchdata's ``Stateful`` protocol, for type checkers (``is_stateful`` is the run-time check)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def is_stateful(obj: Any) -> TypeGuard[Stateful]:
    """torchdata's ``Stateful`` protocol: ``state_dict()`` and ``load_state_dict(state)``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def capture(dataset: Any, iterator: Any, ended: bool, private: bool = False) -> ReplicaState:
    """The replica's state now (``private``: deep-copied, for a state kept in this process)."""
    dataset_state = dataset.state_dict() if is_stateful(dataset) and iterator is not dataset else None
    iter_state = iterator.state_dict() if iterator is not None and is_stateful(iterator) else None
    state: ReplicaState = {
        DATASET_STATE: dataset_state,
        FETCHER_STATE: {DATASET_ITER_STATE: iter_state, FETCHER_ENDED: bool(ended)},
    }
    return copy.deepcopy(state) if private else state


def has_state(state: Mapping[str, Any] | None) -> bool:
    """Whether ``state`` (a ``ReplicaState``, maybe loaded) restores anything (else a resume re-reads
    from the epoch's start)."""
    if not state:
        return False
    fetcher = state.get(FETCHER_STATE) or {}
    return state.get(DATASET_STATE) is not None or fetcher.get(DATASET_ITER_STATE) is not None


def restore(dataset: Any, state: Mapping[str, Any], open_iter: Callable[[Any], Iterator]) -> Iterator:
    """A new iterator of ``dataset`` at ``state`` (a ``ReplicaState``; torchdata's order: dataset,
    iterator, its state)."""
    if state.get(DATASET_STATE) is not None and is_stateful(dataset):
        dataset.load_state_dict(state[DATASET_STATE])
    iterator = open_iter(dataset)
    iter_state = (state.get(FETCHER_STATE) or {}).get(DATASET_ITER_STATE)
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
    """One segment of shared memory per replica: its last ``KEEP`` snapshots ``(epoch, position, state)``.

    Made by the facade for a loader's workers (``create``), written by the worker iterating the
    replica (only it writes that segment), read by its replacement. A write never touches the
    snapshots it replaces: the new pickle goes where it overlaps nothing of the current one,
    then a header (where, how long, its CRC-32) is rewritten in one small write; so a process
    dying mid-write leaves the previous list.
    """

    _HEADER = struct.Struct("<QQI")  # offset, length, CRC-32 of the pickle
    _START = 64  # the first pickle's place (after the header)

    def __init__(self, segments: list[SharedFd], owner: int) -> None:
        self.segments = segments
        self.owner = owner  # the pid that made them: only it closes them (remove)

    @classmethod
    def create(cls, replicas: int) -> SnapshotStore:
        """A segment for each of ``replicas`` replicas (anonymous memory: nothing is left behind)."""
        token = f"procpipe-{os.getpid()}-{secrets.token_hex(4)}-replica"
        segments: list[SharedFd] = []
        try:
            for i in range(max(1, replicas)):
                what = "a replica's snapshots (procpipe.torch.DataLoader)"
                segments.append(SharedFd(new_memory(f"{token}{i}", cls._START, what, "fewer workers", seal=0)))
        except BaseException:
            for segment in segments:
                close_fd(segment.fd)
            raise
        return cls(segments, os.getpid())

    @property
    def replicas(self) -> int:
        """How many replicas it has a segment for."""
        return len(self.segments)

    def _fd(self, worker: int) -> int | None:
        worker = int(worker)
        return self.segments[worker].fd if 0 <= worker < len(self.segments) else None

    def _header(self, fd: int) -> tuple[int, int, int]:
        raw = os.pread(fd, self._HEADER.size, 0)
        return self._HEADER.unpack(raw) if len(raw) == self._HEADER.size else (0, 0, 0)

    def read(self, worker: int) -> list[tuple[int, int, ReplicaState | None]]:
        """Replica ``_worker``'s snapshots, oldest first (empty if none was written)."""
        fd = self._fd(worker)
        if fd is None:
            return []
        try:
            offset, length, crc = self._header(fd)
            if not length:
                return []
            data = os.pread(fd, length, offset)
        except OSError:  # (closed: the DataLoader was closed)
            return []
        if len(data) != length or zlib.crc32(data) != crc:
            return []  # (never seen: a header is written whole, after its pickle)
        return pickle.loads(data)

    def write(self, worker: int, snapshots: Sequence[tuple[int, int, ReplicaState | None]]) -> None:
        """Replace replica ``_worker``'s snapshots (the last ``KEEP``)."""
        fd = self._fd(worker)
        if fd is None:  # (released: the DataLoader was closed)
            return
        data = pickle.dumps(snapshots[-KEEP:], protocol=pickle.HIGHEST_PROTOCOL)
        try:
            offset, length, _ = self._header(fd)
            # before the current pickle if it fits there, else after it: never over it
            at = self._START if not length or len(data) <= offset - self._START else -(-(offset + length) // 64) * 64
            os.pwrite(fd, data, at)
            os.pwrite(fd, self._HEADER.pack(at, len(data), zlib.crc32(data)), 0)
        except OSError:  # the DataLoader was closed while this worker ran
            pass

    def best(self, worker: int, epoch: int, position: int) -> tuple[int, ReplicaState] | None:
        """The latest snapshot of ``_worker``'s replica in ``epoch`` at or before ``position``."""
        found = None
        for e, p, state in self.read(worker):
            if state is None:  # (the mark of a replica opened without a state: mark_opened)
                continue
            if e == epoch and p <= position and (found is None or p >= found[0]):
                found = (p, state)
        return found

    def initial(self, worker: int, epoch: int) -> tuple[bool, ReplicaState | None]:
        """Whether replica ``worker`` has started ``epoch`` (opened its iterator, or failed in
        ``worker_init_fn``), and its state then (None: it has none)."""
        for e, p, state in self.read(worker):
            if e == epoch and p == 0:
                return True, state
        return False, None

    def remove(self) -> None:
        """Release the segments (the loader is closed; in the process that made them only)."""
        if os.getpid() == self.owner:
            for segment in self.segments:
                close_fd(segment.fd)
            self.segments = []
