"""``Dispatcher``: which task goes to which worker, into which ring slot; the task table.

One dispatch round (``round``) sends what may go now, for any source kind: the open
epochs' plans offer tasks, best first (_sources/epoch_plan.py); each goes to a worker (its lane's,
or the least loaded; roster.py) with a ring slot (rings.py). The iteration opens the next
epoch once the open ones have nothing new, so workers go on across the boundary.

A task sent is an ``Attempt`` (attempts.py) in the task table ``attempts`` (by task id)
and in its worker's ``tasks``. Speculation (``speculate=``) gives the batches of
straggling workers to healthy ones too: ``needs_copy`` says which attempts (no
processes involved), ``speculate`` sends them.

Every batch passes through ``send`` once: it builds no object but the ``Attempt`` and the
``Task`` tuple, and reads its collaborators from locals.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._core.messages import Task
from .._core.rings import RingSet
from .attempts import Attempt
from .pool import WorkerLink
from .roster import Roster

if TYPE_CHECKING:
    from .epochs import Epoch, Iteration, Job

_new_tuple = tuple.__new__  # a Task without NamedTuple's argument handling (one per batch)
TIMEOUT_ATTEMPTS = 2  # attempts a batch may have at once, or time out on before the epoch fails


def needs_copy(workers: list[WorkerLink]) -> list[Attempt]:
    """The attempts of straggling (``stalled``) workers whose batch should run elsewhere too:
    not done, not running on a healthy worker as well, not tried as often as a batch may be."""
    out = []
    for w in workers:
        if not w.stalled:
            continue
        for attempt in w.tasks.values():
            job = attempt.job
            if (
                job.done
                or job.epoch.finished
                or any(a.worker.healthy for a in job.attempts)
                or len(job.attempts) + job.timeouts >= TIMEOUT_ATTEMPTS
            ):
                continue
            out.append(attempt)
    return out


class Dispatcher:
    """Sends tasks: the dispatch round, speculation, and the task table.

    ``flush(worker)`` is the coordinator's: it sends what the worker's channel takes now
    and watches for room for the rest. ``uses_ring``: the pool's workers write into the
    ring (else every batch comes back inline)."""

    def __init__(
        self, roster: Roster, rings: RingSet, uses_ring: bool, prefetch: int, flush: Callable[[WorkerLink], None]
    ) -> None:
        self.roster = roster
        self.rings = rings
        self.uses_ring = uses_ring
        self.prefetch = prefetch
        self.flush = flush
        self.attempts: dict[int, Attempt] = {}
        self.unflushed: list[WorkerLink] | None = None  # during a round: the workers sent tasks, to flush at its end
        self.next_attempt_id = 0
        self.max_outstanding = 0
        self.set_outstanding()

    def set_outstanding(self) -> None:
        """Batches in flight or not taken yet, at most: the prefetch depth plus what workers hold."""
        roster = self.roster
        self.max_outstanding = self.prefetch + roster.tasks_per_worker * roster.n_workers

    # ---------------------------------------------------------------- the round
    def round(self, iteration: Iteration) -> bool:
        """Send what may go now; True when something was held back (for want of a slot, a
        worker or consumption): a freed slot should then wake the coordinator."""
        # Tasks in flight and batches not taken yet, counted once: only this thread adds to it
        # (the consumer may take batches meanwhile, which only makes the count high).
        outstanding = iteration.outstanding()
        starved = False
        held_back = False
        unflushed: list[WorkerLink] = []
        self.unflushed = unflushed
        while not iteration.finished:
            last = iteration.fresh()  # opens the next epoch once the open ones have nothing new to dispatch
            for epoch in list(iteration.epochs):
                while True:  # the earlier epoch first: its tasks to run again, then its new ones
                    sent, held_back = self.send_one(epoch, outstanding)
                    starved = starved or held_back
                    if sent is None:
                        break
                    if sent:
                        outstanding += 1
            # Again only if the epoch that had new tasks has sent them all: the next one may open.
            if last is None or last.fresh or held_back:
                break
        self.unflushed = None
        for worker in unflushed:
            self.flush(worker)
        return starved

    def send_one(self, epoch: Epoch, outstanding: int) -> tuple[bool | None, bool]:
        """Send ``epoch``'s best task that may go now: (None: none went, else whether it was a
        new one; whether one was held back for want of a slot, a worker or consumption)."""
        if epoch.finished:
            return None, False
        held_back = False
        roster = self.roster
        most = roster.tasks_per_worker
        slot: int | None
        for offer in epoch.offers(most):
            worker = roster.idle() if offer.lane is None else roster.for_lane(offer, epoch)
            if worker is None or len(worker.tasks) >= most:
                held_back = True
                continue
            if offer.retry is not None:
                job = epoch.take(offer, worker.index)
                slot, job.slot = job.slot, -1  # it has the slot of its lost attempt
            else:
                if not offer.urgent and outstanding >= self.max_outstanding:
                    held_back = True
                    continue
                slot = self.rings.take(epoch.counters)
                if slot is None:
                    # No free slot: before the ring exists (the first batches size it), or when
                    # the consumer holds every slot (e.g. list(loader)). Through the pipe, for
                    # the task the epoch waits for or an idle worker, keeps the pipeline moving
                    # instead of deadlocking; a busy worker has work meanwhile.
                    if self.uses_ring and worker.tasks and not offer.urgent:
                        held_back = True
                        continue
                    slot = -1
                job = epoch.take(offer, worker.index)
            self.send(worker, job, slot)
            return offer.retry is None, held_back
        return None, held_back

    def send(self, worker: WorkerLink, job: Job, slot: int) -> None:
        """Send ``job`` to ``worker`` as a new attempt (in the task table), into ring slot
        ``slot`` (from ``RingSet.take``; -1: none)."""
        rings = self.rings
        ring = rings.current
        if slot >= 0 and not ring.owns(slot):  # type: ignore[union-attr]  # a re-run job's slot in a ring since replaced
            rings.release(slot)
            taken = rings.take(job.epoch.counters)
            slot = -1 if taken is None else taken
        started = None if worker.tasks or not worker.ready else time.perf_counter()  # else: when it starts it
        task_id = self.next_attempt_id
        self.next_attempt_id = task_id + 1
        attempt = Attempt(task_id, job, worker, slot, started)
        self.attempts[task_id] = attempt
        worker.tasks[task_id] = attempt
        job.attempts.append(attempt)
        if slot >= 0:
            worker.map_ring(ring)  # type: ignore[arg-type]  # (sent once per ring, before its first task)
            ring_id, local, slot_bytes = ring.ring_id, slot - ring.first_slot, ring.slot_bytes  # type: ignore[union-attr]
        else:
            ring_id, local, slot_bytes = (ring.ring_id if ring is not None else -1), -1, 0
        # Never a blocking write (a large task to a worker busy in a slow sample would stall
        # the loop): what its pipe does not take now is written when it becomes writable.
        # A worker that is dying drops it; its sentinel fires and the task is redone.
        worker.put(_new_tuple(Task, (task_id, job.epoch.number, job.work.payload, ring_id, local, slot_bytes)))
        unflushed = self.unflushed
        if unflushed is None:
            self.flush(worker)
        elif worker not in unflushed:  # (a round: each worker's tasks go in one write, at its end)
            unflushed.append(worker)

    # ---------------------------------------------------------------- stragglers
    def speculate(self) -> None:
        """Give the batches held by straggling workers to healthy ones too; the first result wins."""
        roster, rings = self.roster, self.rings
        for attempt in needs_copy(roster.links):
            job = attempt.job
            if any(a.worker.healthy for a in job.attempts):
                continue  # copied in this round already (as another attempt of the same job)
            target = roster.idle()
            if target is None:
                return
            epoch = job.epoch
            taken = rings.take(epoch.counters) if rings.current is not None else -1
            if taken is None:
                return
            epoch.counters.speculative_tasks += 1
            self.send(target, job, taken)  # (and a shard's later blocks follow, not behind the straggler:)
            epoch.moved(job, target.index)
