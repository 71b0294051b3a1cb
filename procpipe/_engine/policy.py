"""The ``workers="auto"`` policy: observations of one control interval in, a worker count out.

A pure object (no process, thread or clock: the caller passes the time and what it
measured), so the tests drive it with synthetic throughput curves of any core count
(``tests/test_autotune_curves.py``). The coordinator measures and follows it
(``_engine/autotune.py``, ``_engine/coordinator.py``).

What it knows each interval (a :class:`Sample`): the consumer's throughput and the share
of the interval it waited for batches; the workers' busy time, CPU time and run-queue
time (waiting for a CPU); the training process's own CPU time. And, set by the caller:
``cpus``, the CPUs this loader's workers may use (this process's budget, or its share of
the node when several auto-tuned loaders run there: ``_core/nodeshare.py``), and
``memory_room``.

The law, in full:

1. **A model of what the workers need.** ``demand``: the CPU one busy worker uses
   (``(cpu + runq) / busy``, smoothed, between ``CPU_FLOOR`` and 1; ~1 for CPU-bound
   work, small for workers that sleep on I/O). ``target = (cpus - main_cpu) / demand``:
   the workers the CPUs left by the training process can keep busy (tf.data's
   AUTOTUNE reasoning: parallelism against a CPU budget). ``limit``: the most workers
   ever, ``max``, the ring's capacity, what memory allows and, for CPU-bound work
   (``demand >= 0.5``), ``round(cpus)`` (one more when other processes hold the CPUs:
   workers wait in the run queue more than a quarter of their busy time; not when the
   node is shared with other auto-tuned loaders, whose workers those are); I/O-bound
   work may go to ``cpus / demand``.
2. **Grow in steps that grow while they pay.** While the consumer waits (more than
   ``GROW_WAIT`` of the interval) and the workers are busy, try ``ceil(n * factor)``
   workers (``factor`` starts at 2: 2, 4, 8, 16, 32, 64, 96...), never past
   ``target`` in one step (nor ``limit``), and one more when at ``target``. The first
   interval after a change is not judged (workers starting, queues filling); then the
   mean throughput of up to ``JUDGE_INTERVALS`` intervals is compared with the mean of
   up to 3 before the change (one interval decides when the result is clear; up to
   ``JUDGE_MAX`` while it is within the noise).
3. **Judge.** A step up stays if throughput rose by more than ``GAIN`` and more than
   ``NOISE_K`` times the noise of the difference of the two means (the relative noise
   seen at the count before, scaled for the intervals averaged; a step of ``BIG_STEP`` or
   more needs at most half its linear gain: that is no noise). If it brought less than
   ``EFFICIENCY`` of the linear gain (``(b - a) / a``), the knee is near: ``factor``
   halves towards 1; a step that brought more lets it grow back (at most ``FACTOR``);
   below half the target it stays at least 1.5 (unless a trim found the knee). A step up
   that did not pay is undone, that count is not tried again for a while (``BACKOFF_S``,
   doubling, at most ``BACKOFF_MAX_S``), and ``factor`` halves: the next try is halfway
   (bisection). In noise a trial waits for a baseline of two intervals. When a one-worker step is blocked, the
   count has converged. A step kept with less than ``TRIM`` of the linear gain passed the
   knee: fewer workers may do as well, so the knee is bisected from above ("trims": a
   count halfway down stays if throughput fell by less than ``TRIM_LOSS`` minus twice the
   noise; only where throughput is steady: in noise a trim could keep a count that costs).
4. **Back off for the training process.** When the workers exceed ``target`` by a CPU or
   more (the training step now uses CPUs: ``main_cpu`` rose), try ``target`` at once; it
   stays unless throughput fell by more than ``GAIN``. Above ``limit`` (the node share
   shrank, memory ran short), go to ``limit`` at once.
5. **Idle workers.** If the consumer waits but the workers are mostly idle, the engine's
   per-batch work is the limit: try one fewer, or (blocked, or at ``min``) one more, which
   stays only for a gain above ``IDLE_GAIN``.
6. **Shrink.** After ``SHRINK_AFTER`` intervals in a row in which the consumer hardly
   waited and the workers' busy time would fit in one worker fewer at half load, retire one.

A rise of ``target`` by a CPU or more (CPUs freed, a peer left the node) forgets the
blocked counts and starts the steps at 2 again.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

GROW_WAIT = 0.05  # consumer wait fraction above which more workers are tried
GAIN = 0.05  # a new worker count must raise throughput by this fraction to stay
IDLE_GAIN = 0.20  # ...or by this much, when it was tried while the workers were mostly idle
NOISE_K = 2.0  # ...and in any case by this many times the baseline's interval-to-interval noise
NOISE_WINDOW = 8  # intervals per worker count kept to estimate that noise
BIG_STEP = 0.25  # a step expected to bring at least this gain needs at most half of it to stay
EFFICIENCY = 0.5  # a step bringing less than this share of the linear gain: the knee is near
QUIET_AFTER = 4  # intervals at a count before its noise is trusted (to trim)
TRIM_LOSS = 0.02  # a trim stays if throughput fell by less than this (minus twice the noise)
TRIM = 0.75  # a step kept with less than this share of the linear gain is bisected back (trims)
FACTOR = 2.0  # the first growth factor (doubling); it halves towards 1 near the knee
CLEAR = 0.25  # one interval decides a trial when its gain is this far from the threshold
PROBE_BUSY = 0.5  # workers busier than this (mean fraction) may get more; idler ones, one fewer
JUDGE_INTERVALS = 2  # a trial is judged on the mean of this many intervals (1 when clear)...
JUDGE_MAX = 4  # ...or up to this many, while its gain is within the noise of the threshold
SHRINK_WAIT = 0.01  # consumer wait fraction below which the pipeline has spare capacity
SHRINK_AFTER = 8  # intervals in a row of spare capacity before a worker is retired
SHRINK_LOAD = 0.5  # ...when the remaining workers would be at most this busy
IO_BUSY = 0.5  # workers busy at least this fraction of the interval update the CPU model
IO_CPU = 0.5  # demand below this: I/O-bound (workers may outnumber the CPUs)
CPU_FLOOR = 0.05  # demand never below this (an I/O-bound worker still uses some CPU)
BACKOFF_S = 2.0  # first wait before re-trying a count that did not help
BACKOFF_MAX_S = 60.0
CONTENDED = 0.25  # workers waiting for a CPU this share of their busy time: the CPUs are shared
TRACE_LEN = 2000  # trace entries kept (the most recent)


@dataclass
class Sample:
    """One control interval, as the coordinator measured it."""

    seconds: float
    batches_per_s: float  # batches the consumer took
    wait: float  # fraction of the interval the consumer waited in next()
    busy: float  # worker-seconds spent loading, per second (0..workers)
    cpu: float  # worker CPU-seconds, per second
    runq: float = 0.0  # worker-seconds runnable but waiting for a CPU, per second
    main_cpu: float = 0.0  # the training process's own CPU-seconds per second (all its threads)


def _round(x: float) -> int:
    """Half up (``round`` goes to even: 2.5 -> 2)."""
    return math.floor(x + 0.5)


class Tuner:
    """The policy of the module docstring: ``step(now, sample)`` returns the worker count wanted.

    ``min_workers``/``max_workers``: the bounds (``AutoWorkers``); ``capacity``: workers the
    ring serves; ``workers``: the count in force; ``cpus``: the CPUs this loader's workers
    may use (the caller updates it when the node share changes).
    """

    def __init__(
        self, min_workers: int, max_workers: int, capacity: int, workers: int, started: float, cpus: float
    ) -> None:
        self.min = min_workers
        self.max = max_workers
        self.capacity = capacity
        self.cpus = float(cpus)
        self.workers = workers
        self.started = started
        self.trace: deque[tuple[float, int, float, float]] = deque(maxlen=TRACE_LEN)
        self.demand = 1.0  # CPU per busy worker (1 until measured: assume CPU-bound)
        self.main_cpu = 0.0  # the training process's CPU use, last interval
        self._queued: float | None = None  # smoothed share of busy time waiting for a CPU
        self.contended = False
        self.shared = False  # other auto-tuned loaders share the node (set by the caller): the
        # contention is theirs, so no worker beyond this loader's share is tried
        self.memory_room: int | None = None  # more workers memory allows (None: not measured yet)
        self.factor = FACTOR
        self._settle = 1  # intervals left that are not judged (the first one: start-up)
        # the count on trial: (came_from, its throughput, intervals that measured it, least gain, noise weight,
        # the gain a linear curve would give: a big step needs at most half of it)
        self._trial: tuple[int, float, int, float, float, float] | None = None
        self._judged: list[float] = []
        self._rates: deque[float] = deque(maxlen=3)  # recent throughputs at this count (the baseline)
        self._history: dict[int, deque[float]] = {}  # count -> its recent interval throughputs (noise)
        self._blocked: dict[int, float] = {}  # count -> time before which it is not tried again
        self._backoff: dict[int, float] = {}
        self._knee: tuple[int, int] | None = None  # (worse, as good): bisected down by trims
        self._saturated = False  # a trim held: fewer workers gave as much (the model's target is not the knee)
        self._ceiling = 0  # the target the blocked counts were found under: a rise above it forgets them
        self._spare = 0
        self.wanting = False  # the consumer waited on busy workers last interval (more would help)
        self.changes = 0

    # ---- the model
    @property
    def io_bound(self) -> bool:
        return self.demand < IO_CPU

    @property
    def limit(self) -> int:
        limit = min(self.max, self.capacity)
        if self.io_bound:
            limit = min(limit, math.floor(self.cpus / self.demand + 1e-9))
        else:
            limit = min(limit, _round(self.cpus) + (1 if self.contended and not self.shared else 0))
        if self.memory_room is not None:
            limit = min(limit, self.workers + self.memory_room)
        return max(self.min, limit)

    @property
    def target(self) -> int:
        """The workers the CPUs left by the training process keep busy (at most ``limit``)."""
        free = max(1.0, self.cpus - self.main_cpu)
        return max(self.min, min(self.limit, _round(free / self.demand)))

    def want_cpus(self) -> float:
        """The CPUs to ask of the node (``_core/nodeshare.py``): all it can get while the consumer
        waits on busy workers, else about what it uses now."""
        if self.wanting:
            return math.inf
        return (self.workers * self.demand + self.main_cpu) * 1.25 + 0.5

    def _observe(self, sample: Sample, n: int) -> None:
        self.main_cpu = max(0.0, sample.main_cpu)
        if n and sample.busy >= IO_BUSY * n:
            d = min(1.0, max(CPU_FLOOR, (sample.cpu + sample.runq) / sample.busy))
            self.demand = 0.5 * (self.demand + d)
            queued = min(1.0, sample.runq / sample.busy)
            self._queued = queued if self._queued is None else 0.5 * (self._queued + queued)
            self.contended = self._queued > CONTENDED
        self.wanting = sample.wait > GROW_WAIT and sample.busy >= PROBE_BUSY * n

    # ---- the law
    def step(self, now: float, sample: Sample) -> int:
        """Record one interval and return the worker count for the next one."""
        n = self.workers
        self.trace.append((round(now - self.started, 3), n, round(sample.batches_per_s, 3), round(sample.wait, 4)))
        self._observe(sample, n)
        limit, target = self.limit, self.target
        if target >= self._ceiling + 1:  # more room than before: every count is worth a try again
            self._blocked.clear()
            self.factor = FACTOR
            self._knee = None
            self._saturated = False
            self._ceiling = target
        elif target <= self._ceiling - 2:  # (a swing of one CPU is noise: it clears nothing)
            self._ceiling = target
        if n > limit:  # the share shrank, memory ran short: at once
            self._trial = None
            return self._change(limit)
        if self._settle:
            self._settle -= 1
            return n
        self._history.setdefault(n, deque(maxlen=NOISE_WINDOW)).append(sample.batches_per_s)
        if self._trial is not None:
            decided = self._judge(now, n, sample.batches_per_s)
            if decided is None:
                return n  # one more interval averaged in
            if decided != n:
                return decided
        else:
            self._rates.append(sample.batches_per_s)
        if n >= target + 1 and self._open(target, now):  # the training process needs CPUs: fewer
            return self._try(n, target, -GAIN, 0.0)
        if sample.wait > GROW_WAIT:
            self._spare = 0
            if sample.busy >= PROBE_BUSY * n:
                trim = self._trim_to(n, now)
                if trim == n:
                    return n
                if trim is not None:  # the last step up paid less than linearly: fewer may do as well
                    return self._try(n, trim, -TRIM_LOSS, NOISE_K)
                bigger = self._bigger(n, limit, target, now)
                if bigger and len(self._rates) < 2 and NOISE_K * self._noise(n) > GAIN:
                    return n  # noisy throughput: a baseline of one interval would decide by chance
                return self._try(n, bigger, GAIN, NOISE_K, (bigger - n) / n) if bigger else n
            # Idle workers while the consumer waits: the engine's per-batch work is the limit.
            for m in (n - 1, n + 1):
                if self.min <= m <= limit and self._open(m, now):
                    return self._try(n, m, IDLE_GAIN, NOISE_K) if m > n else self._try(n, m, -GAIN, 0.0)
            return n
        if sample.wait < SHRINK_WAIT and n > self.min and sample.busy <= SHRINK_LOAD * (n - 1):
            self._spare += 1
            if self._spare >= SHRINK_AFTER:
                return self._change(n - 1)
        else:
            self._spare = 0
        return n

    def _bigger(self, n: int, limit: int, target: int, now: float) -> int | None:
        """The next count to try up (None: none allowed now)."""
        if n >= target:
            step = n + 1  # past the model's target: one worker at a time
        else:  # (far below the target the steps stay big: the CPUs are there)
            factor = max(self.factor, 1.5) if 2 * n <= target and not self._saturated else self.factor
            step = min(max(n + 1, math.ceil(n * factor - 1e-9)), target)
        while step > n + 1 and not self._open(step, now):
            step = n + max(1, (step - n) // 2)  # a blocked count: halfway to it
        step = min(step, limit)
        return step if step > n and self._open(step, now) else None

    def _trim_to(self, n: int, now: float) -> int | None:
        """Halfway down to the count below the knee, while one is known (``_knee``), else None."""
        if self._knee is None:
            return None
        low, high = self._knee
        m = (low + high) // 2
        if high != n or m <= low or not self._open(m, now):
            self._knee = None
            return None
        if len(self._history.get(n, ())) < QUIET_AFTER:
            return n  # its noise is not known yet: wait here (as good as any count below)
        if not self._quiet(n):
            self._knee = None  # too noisy to tell a count that costs from one that does not
            return None
        return m

    def _quiet(self, count: int) -> bool:
        """Whether throughput is steady enough to bisect the knee (a trim judged in noise would
        keep a count that costs): the noise at ``count`` is known and below ``GAIN / NOISE_K``."""
        known = len(self._history.get(count, ())) >= QUIET_AFTER
        return known and NOISE_K * max(self._noise(count), self._pooled_noise()) < GAIN

    def _pooled_noise(self) -> float:
        """The relative interval-to-interval noise over every count seen (0 until 4 intervals
        at repeated counts): what a trial's gain is read against before its count has its own."""
        squares, k = 0.0, 0
        for rates in self._history.values():
            if len(rates) >= 2:
                mean = statistics.fmean(rates)
                if mean > 0:
                    squares += sum((r / mean - 1.0) ** 2 for r in rates)
                    k += len(rates) - 1
        return math.sqrt(squares / k) if k >= 4 else 0.0

    def _judge(self, now: float, n: int, rate_now: float) -> int | None:
        """The trial's verdict: the count to keep (None: not clear yet, judge one more interval)."""
        assert self._trial is not None
        came_from, base, k_base, least, weight, linear = self._trial
        self._judged.append(rate_now)
        k = len(self._judged)
        rate = sum(self._judged) / k
        gain = rate / base - 1.0 if base > 0 else (1.0 if rate > 0 else 0.0)
        # The noise of a difference of two means (k intervals against k_base): a gain below
        # ``weight`` times it is not believed (an addition), a loss within it is forgiven (a trim).
        spread = self._noise(came_from) * math.sqrt(1.0 / k + 1.0 / max(1, k_base))
        if weight and least >= 0:
            noise = weight * spread
            if linear >= BIG_STEP:  # (a gain of half the linear one is no noise: believed)
                noise = min(noise, EFFICIENCY * linear)
            needed = max(least, noise)
        else:
            needed = least + weight * spread
        kept = gain > needed if needed > 0 else gain >= needed
        margin = abs(gain - needed)
        if margin < CLEAR and k < JUDGE_INTERVALS:
            return None  # not clear from one interval
        if k < JUDGE_MAX and margin < NOISE_K * spread:
            return None  # within the noise: more intervals (at most JUDGE_MAX)
        self._trial = None
        if kept:
            self._backoff.pop(n, None)
            linear = (n - came_from) / came_from
            short = gain + NOISE_K * self._noise(came_from)  # (a shortfall within the noise is none)
            if n > came_from and short < EFFICIENCY * linear:
                self.factor = 1.0 + (self.factor - 1.0) / 2  # the knee is near: smaller steps
            elif n > came_from:
                self.factor = min(FACTOR, 1.0 + 2 * (self.factor - 1.0))  # it paid: steps grow back
            if n > came_from and short < TRIM * linear and n - came_from > 1:
                self._knee = (came_from, n)  # the knee is in (came_from, n]: fewer may do as well
            elif n < came_from and self._knee is not None:
                self._knee = (self._knee[0], n)  # a trim that held: the knee is lower still
                self._block(came_from, now)  # (no better than this count)
                self.factor = 1.0  # past the knee: one worker at a time from here
                self._saturated = True
            self._rates.clear()
            self._rates.extend(self._judged)
            return n
        self._block(n, now)
        if n > came_from:
            self.factor = 1.0 + (self.factor - 1.0) / 2  # next try: halfway
        elif self._knee is not None:
            self._knee = (n, came_from)  # a trim that cost: throughput still rises up to came_from
        return self._change(came_from, base)

    def _try(self, n: int, m: int, least: float, weight: float, linear: float = 0.0) -> int:
        """Try ``m`` workers (from ``n``): kept if throughput changes by more than ``least`` and,
        for ``weight > 0``, ``weight`` times the noise, or half of ``linear`` (the gain a linear
        curve would give) if that is less and the step is big (``_judge``)."""
        base = sum(self._rates) / len(self._rates) if self._rates else 0.0
        self._trial = (n, base, len(self._rates), least, weight, linear)
        self._judged = []
        return self._change(m)

    def _open(self, count: int, now: float) -> bool:
        return count != self.workers and now >= self._blocked.get(count, 0.0)

    def _noise(self, count: int) -> float:
        """Relative standard deviation of the recent interval throughputs at ``count`` workers
        (the pooled noise while it has fewer than 3)."""
        rates = self._history.get(count, ())
        if len(rates) < 3:
            return self._pooled_noise()
        mean = statistics.fmean(rates)
        return statistics.stdev(rates) / mean if mean > 0 else 0.0

    def _block(self, count: int, now: float) -> None:
        """Do not try ``count`` workers again for a while (2 s, doubling each time, 60 s at most)."""
        wait = self._backoff.get(count, BACKOFF_S)
        self._blocked[count] = now + wait
        self._backoff[count] = min(2 * wait, BACKOFF_MAX_S)

    def _change(self, n: int, rate: float | None = None) -> int:
        n = max(self.min, n)
        if n != self.workers:
            self.changes += 1
            self._settle = 1
            self._spare = 0
            self._rates.clear()
            if rate is not None:  # going back to a count whose throughput is known
                self._rates.append(rate)
        self.workers = n
        return n

    def info(self, workers: int) -> dict[str, Any]:
        """``stats()["autotune"]``."""
        return {
            "workers": workers,
            "min": self.min,
            "max": self.max,
            "limit": self.limit,
            "target": self.target,
            "capacity": self.capacity,
            "cpus": round(self.cpus, 2),
            "main_cpu": round(self.main_cpu, 2),
            "cpu_per_worker": round(self.demand, 3),
            "io_bound": self.io_bound,
            "contended": self.contended,
            "changes": self.changes,
            "trace": [list(t) for t in list(self.trace)],  # list() first: the coordinator thread appends
        }
