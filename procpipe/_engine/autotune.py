"""``workers="auto"``: the settings, and the plumbing between the coordinator and the policy.

The policy (how many workers) is :class:`procpipe._engine.policy.Tuner`, a pure object; its
module docstring states the control law. Here: :class:`AutoWorkers` (the settings),
:class:`Meter` (what the coordinator measures over each control interval: how many batches
the consumer took, how long it waited inside ``next()``, how long the workers were busy
loading, how long they were on a CPU or waiting for one, ``/proc/<pid>/schedstat`` else
psutil, and the training process's own CPU time), :func:`cpu_count` (the CPU budget,
``_core/cpus.py``: affinity and cgroup quota), and what memory allows (:func:`memory_room`,
:func:`ring_workers`).

A control interval lasts at least ``interval`` seconds (default 0.25) and until the consumer
has taken ``min_batches`` batches (default 16), at most ``8 x interval``; an interval in
which a newly started worker is still loading is not closed (it starts again once all are
ready, for at most ``8 x interval``).

Memory: a new worker needs the largest resident size seen in a worker, and the memory this
process may still take (``_core/memory_budget.py``: its cgroup's room, the machine's available
memory) must keep 10 % of the total (at least 256 MiB) free after it; when it falls below that
reserve (other processes took it), the policy's limit drops below the count in force and workers
are retired at once, down to ``min``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import psutil

from .._core.memory_budget import memory_budget
from ..config import AutoWorkers, cpu_count
from .policy import Sample, Tuner

__all__ = ["AutoWorkers", "Meter", "Sample", "Tuner", "cpu_count", "memory_room", "ring_workers"]

MEMORY_RESERVE = 0.10  # fraction of total memory that must stay available
MEMORY_RESERVE_MIN = 256 * 2**20


def memory_room(worker_rss: int) -> int:
    """How many more workers of ``worker_rss`` bytes fit in available memory, keeping a reserve.

    Negative when available memory is already below the reserve: how many workers would
    have to go to give it back (the tuner retires them, one per interval, down to ``min``).
    """
    budget = memory_budget()
    reserve = max(MEMORY_RESERVE * budget.total, MEMORY_RESERVE_MIN)
    return math.floor((budget.available - reserve) / max(worker_rss, 1 << 20))


def ring_workers(directory: str | None, slot_bytes: int, per_worker: int, besides: int, least: int, most: int) -> int:
    """Workers an autotuned ring is sized for: ``most``, within a quarter of the memory this
    process may still take (``memory_budget``: its cgroup's room, available memory) and of the
    free space of ``directory`` (``shm_dir``; None: the ring is anonymous memory), and never
    fewer than ``least``.

    The ring is sized once (rings never grow), so for the most workers the tuner may use;
    the tuner then never goes beyond what the ring serves (its ``capacity``).
    ``per_worker``: slots each worker needs; ``besides``: the other slots (prefetch, the
    consumer's batch).
    """
    try:
        room = memory_budget().available
        if directory is not None:
            room = min(room, psutil.disk_usage(directory).free)
        budget = 0.25 * room
    except OSError:
        budget = 0.0
    fit = int((budget - besides * slot_bytes) // (slot_bytes * per_worker))
    return max(least, min(most, fit))


class Meter:
    """Measures the control intervals the ``Tuner`` judges (coordinator thread).

    An interval lasts at least ``interval`` seconds and until the consumer has taken
    ``min_batches`` batches, at most ``8 * interval`` seconds. A new iteration of the
    loader starts a new one; nothing is measured between iterations.
    """

    def __init__(self, auto: AutoWorkers) -> None:
        self.auto = auto
        self.next_at = 0.0  # time.monotonic() at which to call measure() again
        # the interval's start: (time, iteration, consumed, wait_s, busy_s, this process's CPU s)
        self._base: tuple | None = None
        self._held_since: float | None = None  # when an interval was first held for starting workers
        self._cpu_seen: dict[int, tuple[float, float]] = {}  # pid -> (CPU s, run-queue s) when last read

    def measure(
        self, now: float, iteration: Any, workers: list, counters: list, starting: bool = False
    ) -> Sample | None:
        """Close the interval if it is long enough and return it; else None.

        ``iteration``: the iteration under way (its ``consumed`` and ``wait_s``), None when there
        is nothing to measure; ``workers``: the running workers (their CPU time); ``counters``:
        every worker's ``WorkerCounters`` (their busy time); ``starting``: a worker is still
        loading (the interval starts again once none is, for at most ``8 x interval``).
        """
        auto = self.auto
        self.next_at = now + auto.interval
        if iteration is None:
            self._base = None
            return None
        if starting:
            if self._held_since is None:
                self._held_since = now
            if now - self._held_since < 8 * auto.interval:
                self._base = None  # what this interval measured is start-up, not throughput
                return None
        else:
            self._held_since = None
        base = self._base
        if base is None or base[1] is not iteration:
            self._workers_cpu(workers)
            self._base = (
                now,
                iteration,
                iteration.consumed,
                iteration.wait_s,
                sum(c.busy_s for c in counters),
                time.process_time(),
            )
            return None
        dt = now - base[0]
        consumed = iteration.consumed - base[2]
        if consumed < auto.min_batches and dt < 8 * auto.interval:
            return None  # too few batches to judge yet: extend the interval
        busy = sum(c.busy_s for c in counters)
        cpu, runq = self._workers_cpu(workers)
        wait = iteration.wait_s
        mine = time.process_time()  # every thread of this process: the training step, the coordinator
        self._base = (now, iteration, iteration.consumed, wait, busy, mine)
        return Sample(
            dt,
            consumed / dt,
            min(1.0, max(0.0, (wait - base[3]) / dt)),
            max(0.0, busy - base[4]) / dt,
            cpu / dt,
            runq / dt,
            max(0.0, mine - base[5]) / dt,
        )

    def forget(self, pid: int) -> None:
        """A worker left for good: a new process given its pid starts from zero."""
        self._cpu_seen.pop(pid, None)

    def _workers_cpu(self, workers: list) -> tuple[float, float]:
        """Seconds the live workers' main threads spent on a CPU, and runnable waiting for one,
        since last asked (a new worker: since it started).

        From ``/proc/<pid>/schedstat`` (nanoseconds) where the kernel has it, else psutil's
        CPU times (10 ms ticks; no run-queue figure).
        """
        cpu = runq = 0.0
        seen: dict[int, tuple[float, float]] = {}
        for w in workers:
            pid = w.pid
            if pid is None:  # not a process of this machine
                continue
            now = schedstat_seconds(pid)
            if now is None:
                try:
                    if w.ps is None:
                        w.ps = psutil.Process(pid)
                    t = w.ps.cpu_times()
                except (psutil.Error, TypeError, ValueError):
                    continue
                now = (t.user + t.system, 0.0)
            seen[pid] = now
            before = self._cpu_seen.get(pid, (0.0, 0.0))
            cpu += max(0.0, now[0] - before[0])
            runq += max(0.0, now[1] - before[1])
        self._cpu_seen = seen
        return cpu, runq


def schedstat_seconds(pid: int) -> tuple[float, float] | None:
    """``(seconds on a CPU, seconds runnable but waiting for one)`` of process ``pid``'s main
    thread since it started, from ``/proc/<pid>/schedstat``; None where the kernel has none.
    (The run-queue time is how contention from other processes shows.)"""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            fields = f.read().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None
