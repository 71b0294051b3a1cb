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
import signal
from typing import TYPE_CHECKING

import dill
import psutil

from .._core.messages import ErrorInfo
from .._core.notes import add_note
from .._core.skips import SkipBudget
from .._sources.epoch_plan import Failure
from ..errors import RemoteTraceback, WorkerError, summarize_indices

if TYPE_CHECKING:
    from .attempts import Attempt
    from .epochs import Epoch, Job
    from .pool import WorkerLink

logger = logging.getLogger("procpipe")

__all__ = ["SkipBudget", "death_message", "rebuild_error", "skip_or_fail", "startup_message", "timeout_message"]


def skip_or_fail(
    epoch: Epoch, job: Job, worker: WorkerLink, samples: list[ErrorInfo], batch_error: ErrorInfo | None
) -> bool:
    """on_error="skip": log and count what the batch left out; past the budget, fail the epoch.

    ``samples``: each sample the worker left out; ``batch_error``: why the rest of the batch
    failed (collation), or None. Returns False if the epoch failed.
    """
    skips = epoch.skips
    assert skips is not None, "skip_or_fail runs only with on_error='skip', whose epochs carry a SkipBudget"
    within = True
    for info in samples:
        within = skips.add(
            [info.index],
            f"index {info.index} (batch {job.seq}, worker {worker.index})",
            f"{info.type_name}: {info.message}",
        )
        logger.debug("procpipe: the worker's traceback for index %s:\n%s", info.index, info.traceback)
        if not within:
            error = info
            break
    if within and batch_error is not None and not skips.whole_batches:
        exc = rebuild_error(batch_error, worker, job, epoch.number)
        add_note(
            exc,
            "procpipe: on_error='skip' leaves out a streaming source's records whose fn or augment "
            "raised; an error in open_fn, its iterator or collation ends the epoch (the shard cannot be "
            "read past it).",
        )
        epoch.result(job, Failure(exc))
        return False
    if within and batch_error is not None:
        left = {info.index for info in samples}
        rest = [i for i in job.payload if i not in left]
        where = "collating it" if batch_error.index is None else f"loading index {batch_error.index}"
        within = skips.add(
            rest,
            f"batch {job.seq} ({summarize_indices(rest)}, worker {worker.index})",
            f"{where} failed: {batch_error.type_name}: {batch_error.message}",
        )
        logger.debug("procpipe: the worker's traceback for batch %s:\n%s", job.seq, batch_error.traceback)
        error = batch_error
    if within:
        return True
    exc = rebuild_error(error, worker, job, epoch.number)
    add_note(exc, skips.note())
    epoch.result(job, Failure(exc))
    return False


def rebuild_error(error: ErrorInfo, worker: WorkerLink, job: Job, epoch: int) -> BaseException:
    """The worker's exception, with its original type when it unpickles, plus where it happened."""
    exc: BaseException | None = None
    if error.exc_bytes is not None:
        try:
            exc = dill.loads(error.exc_bytes)
        except Exception:  # noqa: BLE001 - unpickling the user's exception can raise anything; WorkerError stands in
            exc = None
    if not isinstance(exc, BaseException):
        exc = WorkerError(f"{error.type_name}: {error.message}")
    where = (
        f"while loading index {error.index}"
        if error.index is not None
        else f"while collating {summarize_indices(job.payload)}"
    )
    add_note(
        exc,
        f"procpipe: raised in worker {worker.index} {where} (epoch {epoch}, batch {job.seq}); "
        "the worker's traceback is shown above.",
    )
    headline = RemoteTraceback.headline_of(error.type_name, error.message, f"in worker {worker.index} {where}")
    exc.__cause__ = RemoteTraceback(error.traceback, headline)
    return exc


def _where(index: int | None) -> str:
    if index is None:
        return ""
    return " while collating its batch" if index < 0 else f" while loading index {index}"


def timeout_message(job: Job, index: int | None, timeout: float | None, epoch: int) -> str:
    stuck = (
        f"index {index}"
        if index is not None and index >= 0
        else ("collating the batch" if index is not None else "an unknown sample")
    )
    return (
        f"procpipe: batch {job.seq} of epoch {epoch} ({summarize_indices(job.payload)}) was still running after "
        f"task_timeout={timeout} s on each of its {job.timeouts} attempts; the worker was stuck on {stuck}. "
        "Each stuck worker was killed and replaced. Fix what blocks that sample (a hung read, a lock, "
        "an endless loop in fn), or raise task_timeout if it legitimately takes that long."
    )


def death_message(worker: WorkerLink, lost: list[Attempt], index: int | None, budget: int) -> str:
    code = worker.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    indices = [i for a in lost for i in a.job.payload]
    rss = worker.counters.rss_bytes  # sampled every 0.5 s; 0: not yet sampled in this process
    if code == -signal.SIGKILL:
        last = (
            f"the worker's last sampled RSS was {rss / 2**20:.0f} MiB"
            if rss
            else "the worker's RSS is unknown: it died before its memory was first sampled"
        )
        cause = (
            f"SIGKILL usually means the out-of-memory killer ({last}; system memory available: "
            f"{psutil.virtual_memory().available / 2**20:.0f} MiB). Use fewer workers or less memory per sample"
        )
    elif code == -signal.SIGSEGV or code == -signal.SIGBUS:
        cause = "a crash in native code (a C extension used by the dataset or fn)"
    else:
        cause = "user code ended the process (os._exit, sys.exit, or a library calling exit)"
    return (
        f"procpipe {worker.describe()} {how}{_where(index)}, holding "
        f"{summarize_indices(indices)}; workers have already been restarted {budget} times this epoch "
        f"(max_worker_restarts={budget}). Likely cause: {cause}."
    )


def startup_message(worker: WorkerLink, start_method: str) -> str:
    """A worker whose process exited with an error while starting, before it loaded the dataset."""
    message = (
        f"procpipe {worker.describe()} exited with code "
        f"{worker.exitcode} while its process was starting, before it loaded the dataset or "
        f"ran any of your code; its traceback was printed on stderr."
    )
    if start_method != "fork":
        message += (
            f" With start_method={start_method!r} a worker is a fresh process that unpickles the "
            f"dataset and functions: check that the modules they come from import without errors "
            f"in a fresh process."
        )
    return message
