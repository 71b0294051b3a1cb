"""What a worker's death means: which batches run again, whether the epoch fails, what next.

When a worker's process ends (it crashed, was killed after ``task_timeout``, or retired
by autotune), the coordinator collects the attempts it held and asks ``settle``, which
returns a ``Death``: the jobs to run again (a job re-runs from the start: samples are
deterministic from ``(seed, epoch, index)``), the job that has now timed out too often
(the epoch then fails), and the ``Next`` step for the worker: restart it, leave it, or
end the iteration with an error. No process is touched here, so every case is tested
with fake workers (tests/test_coordinator_parts.py); the coordinator carries it out.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

from .dispatch import TIMEOUT_ATTEMPTS
from .pool import WorkerLink

if TYPE_CHECKING:
    from .attempts import Attempt
    from .epochs import Job


class Next(enum.Enum):
    """What becomes of a worker that died."""

    GONE = "gone"  # retired by autotune: it leaves for good
    FATAL = "fatal"  # the dataset, fn or collate_fn failed to load in it: the iteration fails
    CANNOT_START = "cannot_start"  # it failed before any user code: a restart would fail alike
    OVER_BUDGET = "over_budget"  # it died by itself past max_worker_restarts: the epoch fails
    RESTART = "restart"  # start a replacement at its index


class Death:
    """The verdict on one worker's death (``settle``)."""

    __slots__ = ("counts", "next", "redo", "stuck_on", "timed_out")

    def __init__(self, redo: list[Job], timed_out: Job | None, stuck_on: int | None, next: Next, counts: bool) -> None:
        self.redo = redo  # jobs to run again (each keeps its lost attempt's slot in ``job.slot``)
        self.timed_out = timed_out  # a job that timed out TIMEOUT_ATTEMPTS times: the epoch fails
        self.stuck_on = stuck_on  # the index it was loading when it ended, if known (-1: collating)
        self.next = next
        self.counts = counts  # the death counts against max_worker_restarts


def settle(
    worker: WorkerLink, lost: list[Attempt], release: Callable[[int], None], restarts_used: int, max_restarts: int
) -> Death:
    """Account ``lost`` (the attempts ``worker`` held when it died) and decide what next.

    Each lost attempt leaves its job; a job finished elsewhere, of a finished epoch, or
    still running elsewhere (speculation) gives its slot back (``release``); any other
    is to run again. An attempt the worker was killed for counts as one timeout of its
    job. ``restarts_used`` of ``max_restarts`` have been spent this epoch."""
    killed_for = worker.killed_for or (lost[0] if lost else None)
    stuck_on = None if killed_for is None else worker.stuck_on(killed_for)
    redo: list[Job] = []
    timed_out = None
    for attempt in lost:
        job = attempt.job
        job.attempts.remove(attempt)
        if job.done or job.epoch.finished:
            if attempt.slot >= 0:
                release(attempt.slot)  # finished elsewhere, or a stale epoch's
            continue
        if attempt is worker.killed_for:
            job.timeouts += 1
            job.epoch.counters.timed_out_tasks += 1
        if job.attempts:
            if attempt.slot >= 0:
                release(attempt.slot)  # still running elsewhere (speculation)
            continue
        if job.timeouts >= TIMEOUT_ATTEMPTS:
            timed_out = job
        job.slot = attempt.slot
        redo.append(job)
    counts = worker.killed_for is None and worker.counts_as_restart  # it died by itself
    if worker.retiring:
        step = Next.GONE
    elif worker.fatal is not None:
        step = Next.FATAL
    elif worker.failed_to_start():
        step = Next.CANNOT_START
    elif counts and restarts_used >= max_restarts:
        step = Next.OVER_BUDGET
    else:
        step = Next.RESTART
    return Death(redo, timed_out, stuck_on, step, counts)
