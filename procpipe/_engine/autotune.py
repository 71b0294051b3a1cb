"""``workers="auto"``: choose the number of worker processes while the loader runs.

The coordinator thread measures (:class:`Meter`), over each control interval, how many
batches the consumer took, how long it waited inside ``next()``, how long the workers
were busy loading, and how long they were on a CPU or waiting for one
(``/proc/<pid>/schedstat``, else psutil). :class:`Tuner` turns that into a worker count;
the coordinator starts or retires workers to follow it. The policy, in full:

1. Start with ``start`` workers (default 2), never more than the limit below.
2. Every interval (at least ``interval`` seconds and ``min_batches`` batches taken by the
   consumer, at most ``8 * interval`` seconds), compute the consumer's throughput (batches/s)
   and wait fraction, and record ``(time_s, workers, batches_per_s, wait_fraction)`` in the
   trace. The first interval after any change is not judged (start-up, queues refilling).
3. **Probe**: if the consumer waited more than 5 % of the interval, the input pipeline is
   the bottleneck. If the workers were busy at least half the time on average, try one
   more worker (if the limit allows); if they were mostly idle, the limit is the engine's
   per-batch work, not the workers: try one fewer, or, if that count is blocked (below)
   or below ``min``, one more (on a loaded machine an extra worker can still win CPU
   time), which then stays only for a gain above 20 %: idle workers rarely gain, and
   noise alone must not add one. Remember the throughput before.
4. **Judge**: keep an added worker if throughput (the mean over the trial's intervals,
   compared with the mean of up to 3 intervals before it) rose by more than 5 %, and
   by more than twice the noise of the count before it (the relative standard deviation
   of its last 8 intervals: a pipeline whose throughput swings by 25 % from one interval
   to the next needs a 50 % gain), a removed one if it fell by less than 5 %; otherwise
   go back. One interval decides
   when the result is clear (for an added worker: a gain above 20 % or a loss above
   10 %; for a removed one: a gain above 5 % or a loss above 20 %), else a second
   interval is averaged in. The count that was
   not better is not tried again for a while (2 s, doubling on every failed try, at most
   60 s), so the tuner re-probes rarely instead of thrashing.
5. **Shrink**: if for 8 intervals in a row the consumer waited less than 1 % and the
   workers' busy time would fit in one worker fewer at 50 % load, retire one (the
   consumer is the bottleneck: workers only cost CPU and memory). A worker count above
   the limit (e.g. memory ran short) is also brought down, one per interval.

The limit is the smallest of: ``max`` (default ``4 x CPUs``, at most 32), the workers the
ring was sized for, the CPU count unless the workers are I/O-bound (one more when the
CPUs are contended: workers wait in the run queue more than a quarter of their busy
time, because other processes hold the CPUs; like every addition, that worker stays
only if it raises throughput by more than 5 %), and what available memory allows.
Workers count as I/O-bound when they are busy at least half of the interval on average
but spend less than half of that busy time on a CPU or waiting for one (they sleep, or
wait on disk or network). ``/proc/<pid>/schedstat`` gives both
CPU time and run-queue time, so a CPU-bound pipeline on a busy machine is not mistaken
for an I/O-bound one; the share is smoothed over intervals. Only then may the count
exceed the CPUs. Memory: a new worker needs the largest resident size seen in a worker, and ``psutil``'s available
memory must keep 10 % of the total (at least 256 MiB) free after it; when available memory
falls below that reserve (other processes took it), workers are retired, one per interval,
until it is back or ``min`` is reached.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import psutil

from ..config import AutoWorkers, cpu_count

GROW_WAIT = 0.05  # consumer wait fraction above which more workers are tried
GAIN = 0.05  # a new worker must raise throughput by this fraction to stay
IDLE_GAIN = 0.20  # ...or by this much, when it was tried while the workers were mostly idle
NOISE_K = 2.0  # ...and in any case by this many times the baseline's interval-to-interval noise
NOISE_WINDOW = 8  # intervals per worker count kept to estimate that noise
PROBE_BUSY = 0.5  # workers busier than this (mean fraction) may get one more; idler ones, one fewer
JUDGE_INTERVALS = 2  # a trial is judged on the mean of up to this many intervals
SHRINK_WAIT = 0.01  # consumer wait fraction below which the pipeline has spare capacity
SHRINK_AFTER = 8  # intervals in a row of spare capacity before a worker is retired
SHRINK_LOAD = 0.5  # ...when the remaining workers would be at most this busy
IO_BUSY = 0.5  # workers busy at least this fraction of the interval, on average...
IO_CPU = 0.5  # ...and on (or waiting for) a CPU less than this fraction of their busy time: I/O-bound
BACKOFF_S = 2.0  # first wait before re-trying a count that did not help
BACKOFF_MAX_S = 60.0
CONTENDED = 0.25  # workers waiting for a CPU this share of their busy time: the CPUs are shared
TRACE_LEN = 2000  # trace entries kept (the most recent)
MEMORY_RESERVE = 0.10  # fraction of total memory that must stay available
MEMORY_RESERVE_MIN = 256 * 2**20


def memory_room(worker_rss: int) -> int:
    """How many more workers of ``worker_rss`` bytes fit in available memory, keeping a reserve.

    Negative when available memory is already below the reserve: how many workers would
    have to go to give it back (the tuner retires them, one per interval, down to ``min``).
    """
    vm = psutil.virtual_memory()
    reserve = max(MEMORY_RESERVE * vm.total, MEMORY_RESERVE_MIN)
    return math.floor((vm.available - reserve) / max(worker_rss, 1 << 20))


def ring_workers(directory: str, slot_bytes: int, per_worker: int, besides: int, least: int, most: int) -> int:
    """Workers an autotuned ring is sized for: ``most``, within a quarter of the free space
    of ``directory`` (``shm_dir``) and of available memory, and never fewer than ``least``.

    The ring is sized once (rings never grow), so for the most workers the tuner may use;
    the tuner then never goes beyond what the ring serves (its ``capacity``).
    ``per_worker``: slots each worker needs; ``besides``: the other slots (prefetch, the
    consumer's batch).
    """
    try:
        budget = 0.25 * min(psutil.disk_usage(directory).free, psutil.virtual_memory().available)
    except OSError:
        budget = 0.0
    fit = int((budget - besides * slot_bytes) // (slot_bytes * per_worker))
    return max(least, min(most, fit))


@dataclass
class Sample:
    """One control interval, as the coordinator measured it."""

    seconds: float
    batches_per_s: float  # batches the consumer took
    wait: float  # fraction of the interval the consumer waited in next()
    busy: float  # worker-seconds spent loading, per second (0..workers)
    cpu: float  # worker CPU-seconds, per second
    runq: float = 0.0  # worker-seconds runnable but waiting for a CPU, per second


class Meter:
    """Measures the control intervals the ``Tuner`` judges (coordinator thread).

    An interval lasts at least ``interval`` seconds and until the consumer has taken
    ``min_batches`` batches, at most ``8 * interval`` seconds. A new iteration of the
    loader starts a new one; nothing is measured between iterations.
    """

    def __init__(self, auto: AutoWorkers) -> None:
        self.auto = auto
        self.next_at = 0.0  # time.monotonic() at which to call measure() again
        self._base: tuple | None = None  # the interval's start: (time, stream, consumed, wait_s, busy_s)
        self._cpu_seen: dict[int, tuple[float, float]] = {}  # pid -> (CPU s, run-queue s) when last read

    def measure(self, now: float, stream: Any, workers: list, counters: list) -> Sample | None:
        """Close the interval if it is long enough and return it; else None.

        ``stream``: the iteration under way (its ``consumed`` and ``wait_s``), None when there
        is nothing to measure; ``workers``: the running workers (their CPU time); ``counters``:
        every worker's ``WorkerCounters`` (their busy time).
        """
        auto = self.auto
        self.next_at = now + auto.interval
        if stream is None:
            self._base = None
            return None
        base = self._base
        if base is None or base[1] is not stream:
            self._workers_cpu(workers)
            self._base = (now, stream, stream.consumed, stream.wait_s, sum(c.busy_s for c in counters))
            return None
        dt = now - base[0]
        consumed = stream.consumed - base[2]
        if consumed < auto.min_batches and dt < 8 * auto.interval:
            return None  # too few batches to judge yet: extend the interval
        busy = sum(c.busy_s for c in counters)
        cpu, runq = self._workers_cpu(workers)
        wait = stream.wait_s
        self._base = (now, stream, stream.consumed, wait, busy)
        return Sample(
            dt,
            consumed / dt,
            min(1.0, max(0.0, (wait - base[3]) / dt)),
            max(0.0, busy - base[4]) / dt,
            cpu / dt,
            runq / dt,
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


class Tuner:
    """The policy of the module docstring: ``step(sample)`` returns the worker count wanted."""

    def __init__(self, auto: AutoWorkers, capacity: int, workers: int, started: float) -> None:
        self.auto = auto
        self.capacity = capacity  # workers the ring (and status file) can serve
        self.cpus = cpu_count()
        self.workers = workers
        self.started = started
        self.trace: deque[tuple[float, int, float, float]] = deque(maxlen=TRACE_LEN)
        self.io_bound = False
        self._off_cpu: float | None = None  # smoothed share of busy time neither on nor waiting for a CPU
        self._queued: float | None = None  # smoothed share of busy time waiting for a CPU
        self.contended = False  # workers wait for CPUs that other processes hold
        self.memory_room: int | None = None  # more workers memory allows (None: not measured yet)
        self._settle = 1  # intervals left that are not judged (the first one: start-up)
        self._probe_base: float | None = None  # throughput before the count now on trial
        self._probe_step = 0  # +1: a worker was added for trial; -1: one was retired
        self._probe_gain = GAIN  # the gain an added worker must bring to stay
        self._judged: list[float] = []  # throughputs measured since the trial began
        self._rates: deque[float] = deque(maxlen=3)  # recent throughputs at this count (the baseline)
        self._history: dict[int, deque[float]] = {}  # count -> its recent interval throughputs (noise)
        self._blocked: dict[int, float] = {}  # count -> time before which it is not tried again
        self._backoff: dict[int, float] = {}
        self._spare = 0  # intervals in a row with spare capacity
        self.changes = 0

    @property
    def limit(self) -> int:
        limit = min(self.auto.hard_max, self.capacity)
        if not self.io_bound:
            limit = min(limit, max(self.cpus + (1 if self.contended else 0), self.auto.min))
        if self.memory_room is not None:
            limit = min(limit, self.workers + self.memory_room)
        return max(self.auto.min, limit)

    def step(self, now: float, sample: Sample) -> int:
        """Record one interval and return the worker count for the next one."""
        n = self.workers
        self.trace.append((round(now - self.started, 3), n, round(sample.batches_per_s, 3), round(sample.wait, 4)))
        if n and sample.busy >= IO_BUSY * n:
            off = max(0.0, sample.busy - sample.cpu - sample.runq) / sample.busy
            queued = min(1.0, sample.runq / sample.busy)
            self._off_cpu = off if self._off_cpu is None else 0.5 * (self._off_cpu + off)
            self._queued = queued if self._queued is None else 0.5 * (self._queued + queued)
            self.io_bound = self._off_cpu > 1.0 - IO_CPU
            self.contended = self._queued > CONTENDED
        if self._settle:
            self._settle -= 1
            return n
        self._history.setdefault(n, deque(maxlen=NOISE_WINDOW)).append(sample.batches_per_s)
        if self._probe_base is not None:  # judging the count tried since the last change
            base = self._probe_base
            self._judged.append(sample.batches_per_s)
            rate = sum(self._judged) / len(self._judged)
            up = self._probe_step > 0
            came_from = n - self._probe_step
            gain = max(self._probe_gain, NOISE_K * self._noise(came_from))
            kept = rate > (1.0 + gain) * base if up else rate >= (1.0 - GAIN) * base
            # One interval decides when the result is clear; else a second one is averaged in.
            if up:
                clear = rate > (1.0 + max(4 * GAIN, gain)) * base or rate < (1.0 - 2 * GAIN) * base
            else:
                clear = rate > (1.0 + GAIN) * base or rate < (1.0 - 4 * GAIN) * base
            if not clear and len(self._judged) < JUDGE_INTERVALS:
                return n
            self._probe_base = None
            if kept:  # more workers helped, or fewer did as well
                self._backoff.pop(n, None)
                self._block(came_from, now)  # known to be no better: not tried again for a while
                self._rates.clear()
                self._rates.extend(self._judged)
            else:
                self._block(n, now)
                return self._change(came_from, base)
        else:
            self._rates.append(sample.batches_per_s)
        limit = self.limit
        if n > limit:
            return self._change(n - 1)
        if sample.wait > GROW_WAIT:
            self._spare = 0
            # Busy workers: try one more. Idle ones: the engine is the limit, so try one fewer;
            # and where that is not allowed, one more after all (when its backoff allows):
            # the machine's load changes, and a worker fewer may have stopped paying off.
            # Such a worker must then bring a clear gain (IDLE_GAIN), not one within the noise.
            idle = sample.busy < PROBE_BUSY * n
            for step in (-1, +1) if idle else (+1,):
                if self.auto.min <= n + step <= limit and now >= self._blocked.get(n + step, 0.0):
                    return self._probe(n, step, IDLE_GAIN if idle else GAIN)
            return n
        if sample.wait < SHRINK_WAIT and n > self.auto.min and sample.busy <= SHRINK_LOAD * (n - 1):
            self._spare += 1
            if self._spare >= SHRINK_AFTER:
                return self._change(n - 1)
        else:
            self._spare = 0
        return n

    def _probe(self, n: int, step: int, gain: float) -> int:
        self._probe_base = sum(self._rates) / len(self._rates)
        self._probe_step = step
        self._probe_gain = gain
        self._judged = []
        return self._change(n + step)

    def _noise(self, count: int) -> float:
        """Relative standard deviation of the recent interval throughputs at ``count`` workers."""
        rates = self._history.get(count, ())
        if len(rates) < 3:
            return 0.0
        mean = statistics.fmean(rates)
        return statistics.stdev(rates) / mean if mean > 0 else 0.0

    def _block(self, count: int, now: float) -> None:
        """Do not try ``count`` workers again for a while (2 s, doubling each time, 60 s at most)."""
        wait = self._backoff.get(count, BACKOFF_S)
        self._blocked[count] = now + wait
        self._backoff[count] = min(2 * wait, BACKOFF_MAX_S)

    def _change(self, n: int, rate: float | None = None) -> int:
        self.workers = n
        self.changes += 1
        self._settle = 1
        self._spare = 0
        self._rates.clear()
        if rate is not None:  # going back to a count whose throughput is known
            self._rates.append(rate)
        return n

    def info(self, workers: int) -> dict[str, Any]:
        """``stats()["autotune"]``."""
        return {
            "workers": workers,
            "min": self.auto.min,
            "max": self.auto.hard_max,
            "limit": self.limit,
            "capacity": self.capacity,
            "cpus": self.cpus,
            "io_bound": self.io_bound,
            "contended": self.contended,
            "changes": self.changes,
            "trace": [list(t) for t in list(self.trace)],  # list() first: the coordinator thread appends
        }
