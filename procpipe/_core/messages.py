"""The messages between the coordinator and a worker, as named tuples.

A worker pool (pool.py: local processes; procpipe.ray: Ray agents) carries them; the
coordinator and the worker loop (_worker/process.py) read them by field name, never by position.
Named tuples pickle with the C pickler by reference to this module (a few bytes more than
a plain tuple), so the wire stays cheap (wire.py).

Coordinator -> worker:

- ``Task``: load ``payload`` (a list of indices, or a ``procpipe._sources.stream.Block``) of
  epoch ``epoch`` into slot ``slot`` of ring ``ring_id`` (``slot = -1``: no slot, the
  arrays come back in the reply);
- ``MapRing``: ring ``ring_id``'s shared memory (``nbytes``), whose descriptor comes with
  this message (``SCM_RIGHTS``, wire.py); sent once per ring to each worker, before the
  first task that names it;
- ``STOP`` (``None``): finish and exit.

Worker -> coordinator, in this order per task:

- ``SamplesSkipped``: with ``on_error="skip"``, the samples left out of the task's batch
  (sent before its ``BatchDone``);
- ``BatchDone``: the batch is in its slot (``in_slot``) or inline in ``layout``
  (collate.py); ``layout`` is None when every sample was skipped;
- ``BatchFailed``: user code raised (``error.index`` None: collating it failed);
- ``WorkerReady``: the worker has loaded the dataset and functions (sent once, first): a
  task's time (``task_timeout``, ``speculate``) counts from here, not from the process start;
- ``WorkerFatal``: the worker could not load the dataset and functions at all;
- ``WorkerLost``: (remote pools only) the process running the task died, ``exitcode``
  and the index it was loading, as far as known.
"""

from __future__ import annotations

from typing import Any, NamedTuple

STOP = None  # the message that tells a worker to exit


class Task(NamedTuple):
    """One attempt at one batch (or block), as the worker receives it."""

    id: int
    epoch: int
    payload: Any  # list[int], or a procpipe._sources.stream.Block
    ring_id: int
    slot: int  # -1: no slot, reply inline
    slot_bytes: int


class MapRing(NamedTuple):
    """A ring generation's segment for the worker to map: its descriptor travels with the message."""

    ring_id: int
    nbytes: int


class ErrorInfo(NamedTuple):
    """An exception raised in a worker, as ``faults.rebuild_error`` rebuilds it."""

    index: Any  # the index (or record) being loaded; None: collation or batch_fn
    exc_bytes: bytes | None  # the exception pickled with dill, if it pickled
    type_name: str
    message: str
    traceback: str


class BatchDone(NamedTuple):
    task_id: int
    layout: list | None
    nbytes: int
    in_slot: bool
    busy_s: float


class BatchFailed(NamedTuple):
    task_id: int
    error: ErrorInfo
    busy_s: float


class SamplesSkipped(NamedTuple):
    task_id: int
    samples: list  # [ErrorInfo, ...]


class WorkerReady(NamedTuple):
    pid: int


class WorkerFatal(NamedTuple):
    traceback: str


class WorkerLost(NamedTuple):
    """A remote pool's worker process died while it held ``task_id``."""

    task_id: int
    exitcode: int | None
    index: int | None  # type: ignore[assignment]  # the field's name on the wire; it shadows tuple.index, unused here


Reply = BatchDone | BatchFailed | SamplesSkipped | WorkerReady | WorkerFatal | WorkerLost

# Every message the wire carries (wire.py sends each as a plain tuple tagged with its index here).
WIRE_TYPES = (Task, BatchDone, BatchFailed, SamplesSkipped, WorkerReady, WorkerFatal, WorkerLost, MapRing)
