"""``Attempt``: one run of a batch (a ``Job``, epochs.py) on one worker.

A job normally has one attempt; it gets another when its worker dies, straggles
(``speculate``) or is killed after ``task_timeout`` (coordinator.py). Each attempt has its
own ring slot, so a late reply of a lost race never writes into a slot someone reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .epochs import Job


class Attempt:
    """One run of a job on one worker, into its own slot (-1: arrays come back inline).

    A plain slotted class: one is made per batch, on the coordinator's hot path."""

    __slots__ = ("id", "job", "skipped", "slot", "started", "worker")

    def __init__(self, id: int, job: Job, worker: Any, slot: int, started: float | None) -> None:
        self.id = id
        self.job = job
        self.worker = worker  # the pool.WorkerLink running it
        self.slot = slot
        self.started = started  # when the worker began it; None while queued behind another task
        self.skipped: list | None = None  # ErrorInfo of the samples the worker left out (on_error="skip")
