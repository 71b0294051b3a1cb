"""Faults: what a failure in a worker becomes in the consumer.

A worker that raises sends the exception back (pickled with dill, plus its type name,
message and formatted traceback). ``rebuild_error`` turns it into the exception the
consumer sees: the original type where it unpickles, with a note saying which worker,
index, epoch and batch it came from, and the worker's traceback as ``__cause__``. With
``on_error="skip"`` (``SkipBudget``, ``skip_or_fail``) a failed sample is logged and left
out of its batch instead, until the epoch has skipped more than ``max_skipped``.

The coordinator's own verdicts, a batch stuck past ``task_timeout`` on every attempt
and workers dying past ``max_worker_restarts``, get messages that say what happened and
what to do about it (``timeout_message``, ``death_message``, ``startup_message``).
"""
from __future__ import annotations

import logging
import math
import signal
from typing import TYPE_CHECKING

import dill
import psutil

from .epochs import Failure
from .errors import RemoteTraceback, WorkerError, summarize_indices
from .stats import EpochCounters

if TYPE_CHECKING:
    from .epochs import Attempt, Epoch, Job
    from .pool import WorkerHandle

logger = logging.getLogger("procpipe")


class SkipBudget:
    """``on_error="skip"`` for one epoch: logs each skip, records it, enforces ``max_skipped``.

    ``max_skipped`` is a count (int) or a fraction of the epoch's ``samples`` (float, rounded
    up). ``whole_batches``: a batch that failed as a whole (collation; for a streaming source,
    its shard's iterator) may be skipped too; a stream cannot, since its shard cannot be read
    past the error (the epoch would end that shard short).
    """

    def __init__(self, max_skipped: int | float, samples: int, counters: EpochCounters,
                 whole_batches: bool = True) -> None:
        if isinstance(max_skipped, float):
            max_skipped = math.ceil(max_skipped * samples)
        self.limit = max_skipped
        self.counters = counters
        self.whole_batches = whole_batches

    def add(self, indices: list[int], what: str, error: str) -> bool:
        """Record ``indices`` as skipped; False once the epoch has skipped more than allowed."""
        self.counters.skipped.extend(indices)
        logger.warning("procpipe skipped %s (epoch %d): %s", what, self.counters.epoch, error)
        return len(self.counters.skipped) <= self.limit

    def note(self) -> str:
        return (f"procpipe: on_error='skip' has left out {len(self.counters.skipped)} samples of epoch "
                f"{self.counters.epoch} (indices {self.counters.skipped}), more than max_skipped allows "
                f"({self.limit}); this error is raised instead of being skipped.")


def skip_or_fail(epoch: Epoch, job: Job, worker: WorkerHandle, samples: list[tuple],
                 batch_error: tuple | None) -> bool:
    """on_error="skip": log and count what the batch left out; past the budget, fail the epoch.

    ``samples``: ``(index, ...)`` of each sample the worker left out; ``batch_error``: why
    the rest of the batch failed (collation), or None. Returns False if the epoch failed.
    """
    skips = epoch.skips
    within = True
    for info in samples:
        within = skips.add([info[0]], f"index {info[0]} (batch {job.seq}, worker {worker.index})",
                           f"{info[2]}: {info[3]}")
        logger.debug("procpipe: the worker's traceback for index %s:\n%s", info[0], info[4])
        if not within:
            error = info
            break
    if within and batch_error is not None and not skips.whole_batches:
        exc = rebuild_error(batch_error, worker, job, epoch.number)
        exc.add_note("procpipe: on_error='skip' leaves out a streaming source's records whose fn or augment "
                     "raised; an error in open_fn, its iterator or collation ends the epoch (the shard cannot be "
                     "read past it).")
        epoch.deliver(job.seq, Failure(exc))
        return False
    if within and batch_error is not None:
        left = {info[0] for info in samples}
        rest = [i for i in job.indices if i not in left]
        where = "collating it" if batch_error[0] is None else f"loading index {batch_error[0]}"
        within = skips.add(rest, f"batch {job.seq} ({summarize_indices(rest)}, worker {worker.index})",
                           f"{where} failed: {batch_error[2]}: {batch_error[3]}")
        logger.debug("procpipe: the worker's traceback for batch %s:\n%s", job.seq, batch_error[4])
        error = batch_error
    if within:
        return True
    exc = rebuild_error(error, worker, job, epoch.number)
    exc.add_note(skips.note())
    epoch.deliver(job.seq, Failure(exc))
    return False


def rebuild_error(error: tuple, worker: WorkerHandle, job: Job, epoch: int) -> BaseException:
    """The worker's exception, with its original type when it unpickles, plus where it happened.

    ``error``: ``(index, exc_bytes, type_name, message, traceback)`` as the worker sent it.
    """
    index, exc_bytes, type_name, text, tb = error
    exc: BaseException | None = None
    if exc_bytes is not None:
        try:
            exc = dill.loads(exc_bytes)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = WorkerError(f"{type_name}: {text}")
    where = (f"while loading index {index}" if index is not None
             else f"while collating {summarize_indices(job.indices)}")
    exc.add_note(f"procpipe: raised in worker {worker.index} {where} (epoch {epoch}, batch {job.seq}); "
                 "the worker's traceback is shown above.")
    exc.__cause__ = RemoteTraceback(tb)
    return exc


def _where(index: int | None) -> str:
    if index is None:
        return ""
    return " while collating its batch" if index < 0 else f" while loading index {index}"


def timeout_message(job: Job, index: int | None, timeout: float | None, epoch: int) -> str:
    stuck = f"index {index}" if index is not None and index >= 0 else (
        "collating the batch" if index is not None else "an unknown sample")
    return (f"procpipe: batch {job.seq} of epoch {epoch} ({summarize_indices(job.indices)}) was still running after "
            f"task_timeout={timeout} s on each of its {job.timeouts} attempts; the worker was stuck on {stuck}. "
            "Each stuck worker was killed and replaced. Fix what blocks that sample (a hung read, a lock, "
            "an endless loop in fn), or raise task_timeout if it legitimately takes that long.")


def death_message(worker: WorkerHandle, lost: list[Attempt], index: int | None, budget: int) -> str:
    code = worker.process.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    indices = [i for a in lost for i in a.job.indices]
    rss = worker.counters.rss_bytes  # sampled every 0.5 s; 0: not yet sampled in this process
    if code == -signal.SIGKILL:
        last = (f"the worker's last sampled RSS was {rss / 2**20:.0f} MiB" if rss
                else "the worker's RSS is unknown: it died before its memory was first sampled")
        cause = (f"SIGKILL usually means the out-of-memory killer ({last}; system memory available: "
                 f"{psutil.virtual_memory().available / 2**20:.0f} MiB). Use fewer workers or less memory per sample")
    elif code == -signal.SIGSEGV or code == -signal.SIGBUS:
        cause = "a crash in native code (a C extension used by the dataset or fn)"
    else:
        cause = "user code ended the process (os._exit, sys.exit, or a library calling exit)"
    return (f"procpipe worker {worker.index} (pid {worker.process.pid}) {how}{_where(index)}, holding "
            f"{summarize_indices(indices)}; workers have already been restarted {budget} times this epoch "
            f"(max_worker_restarts={budget}). Likely cause: {cause}.")


def startup_message(worker: WorkerHandle, start_method: str) -> str:
    """A worker whose process exited with an error while starting, before it loaded the dataset."""
    message = (f"procpipe worker {worker.index} (pid {worker.process.pid}) exited with code "
               f"{worker.process.exitcode} while its process was starting, before it loaded the dataset or "
               f"ran any of your code; its traceback was printed on stderr.")
    if start_method != "fork":
        message += (f" With start_method={start_method!r} a worker is a fresh process that unpickles the "
                    f"dataset and functions: check that the modules they come from import without errors "
                    f"in a fresh process.")
    return message
