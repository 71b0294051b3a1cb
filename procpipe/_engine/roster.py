"""``Roster``: the coordinator's workers, their counters and states, and who gets the next task.

A worker is a ``WorkerLink`` (pool.py); its flags (ready, stalled, killed, dead, retiring)
are the coordinator's bookkeeping, changed only through the roster's methods, and read as
one ``WorkerState``. The roster picks the worker for a task (``idle``, ``for_lane``) and
the index for a new one (autotune), and never starts, stops or talks to a process itself:
``start`` asks the pool.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from .._core.stats import WorkerCounters
from .pool import WorkerLink, WorkerPool

if TYPE_CHECKING:
    from .._sources.epoch_plan import Offer
    from .epochs import Epoch


class WorkerState(enum.Enum):
    """Where a worker is in its life, as the coordinator sees it."""

    STARTING = "starting"  # started, has not loaded the dataset and functions yet
    READY = "ready"  # loaded, holds no task
    BUSY = "busy"  # holds tasks (it may be straggling)
    RETIRING = "retiring"  # autotune: gets no more tasks, stops once idle
    DEAD = "dead"  # killed (task_timeout), failed to start, or died past the restart budget


def state_of(worker: WorkerLink) -> WorkerState:
    """``worker``'s state, from its flags."""
    if worker.dead or worker.killed_for is not None or worker.fatal is not None:
        return WorkerState.DEAD
    if worker.retiring:
        return WorkerState.RETIRING
    if worker.tasks:
        return WorkerState.BUSY
    return WorkerState.READY if worker.ready else WorkerState.STARTING


class Roster:
    """The workers given tasks (``links``), indexed ``0..capacity-1``, and their counters.

    ``n_workers`` counts the workers given tasks (autotune changes it; retiring ones are
    not counted); ``tasks_per_worker`` is how many a worker holds at once."""

    def __init__(self, pool: WorkerPool, capacity: int, n_workers: int, tasks_per_worker: int) -> None:
        self.pool = pool
        self.capacity = capacity
        self.n_workers = n_workers
        self.tasks_per_worker = tasks_per_worker
        self.links: list[WorkerLink] = []
        self.counters: list[WorkerCounters] = []  # by worker index, kept across restarts

    # ---- starting and leaving
    def start(self, index: int) -> WorkerLink:
        """Ask the pool to start worker ``index`` (a replacement keeps its index and counters)."""
        while len(self.counters) <= index:
            self.counters.append(WorkerCounters())
        return self.pool.start(index, self.counters[index])

    def free_index(self) -> int | None:
        """The lowest index no worker holds (autotune's next worker), or None at capacity."""
        used = {w.index for w in self.links}
        return next((i for i in range(self.capacity) if i not in used), None)

    def to_retire(self) -> WorkerLink | None:
        """The worker autotune retires next: the live one with the highest index (never the last)."""
        live = [w for w in self.links if not (w.retiring or w.dead)]
        if len(live) <= 1:
            return None
        return max(live, key=lambda w: w.index)

    def retire(self, worker: WorkerLink) -> None:
        """``worker`` gets no more tasks, and is told to stop once idle."""
        worker.retiring = True
        self.n_workers -= 1
        worker.stop_if_idle()

    def replace(self, old: WorkerLink, new: WorkerLink) -> None:
        self.links[self.links.index(old)] = new

    def remove(self, worker: WorkerLink) -> None:
        if worker in self.links:
            self.links.remove(worker)

    # ---- state changes
    @staticmethod
    def mark_ready(worker: WorkerLink) -> None:
        worker.ready = True

    @staticmethod
    def mark_dead(worker: WorkerLink) -> None:
        """No restart until the next epoch starts (a crash loop must not spin between epochs)."""
        worker.dead = True

    @staticmethod
    def mark_fatal(worker: WorkerLink, traceback: str) -> None:
        worker.fatal = traceback

    def states(self) -> dict[int, WorkerState]:
        """Each worker's state, by index."""
        return {w.index: state_of(w) for w in self.links}

    def any_usable(self) -> bool:
        return any(w.usable for w in self.links)

    # ---- choosing
    def idle(self) -> WorkerLink | None:
        """The healthy worker with the fewest tasks, if it can take one more."""
        best = None
        most = self.tasks_per_worker
        for w in self.links:
            if not w.usable or w.stalled or len(w.tasks) >= most:
                continue
            if best is None or len(w.tasks) < len(best.tasks):
                best = w
        return best

    def for_lane(self, offer: Offer, epoch: Epoch) -> WorkerLink | None:
        """The worker for ``offer``, which has a lane: the lane's (None while that one cannot take
        it), else (a lane not held yet, or its worker gone, retiring or straggling) the least loaded
        healthy one. (An offer without a lane goes to ``idle``.) A straggler (``stalled``, speculate=)
        gets no more work: its lane moves even when none of its tasks was copied elsewhere (the
        lane's later blocks would otherwise wait for the straggler's reply)."""
        if offer.worker is not None:
            for w in self.links:
                if w.index == offer.worker:
                    if w.retiring or w.stalled or w.dead or w.fatal:
                        break  # retiring, straggling, or dead for this epoch: the lane moves
                    return w if w.usable else None
        # The lane's first task, or its worker is gone: the worker with the fewest lanes takes it
        # (if it is not the lane's first task, that worker opens the shard again and skips ahead).
        load = epoch.plan.lanes_held()
        usable = [w for w in self.links if w.usable and not w.stalled]
        if not usable:
            return None
        return min(usable, key=lambda w: (load.get(w.index, 0), len(w.tasks), w.index))
