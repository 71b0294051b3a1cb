"""Measuring a loader at one worker count, and choosing the worker count from a sweep.

:func:`measure` builds a loader, takes its first batch (timed apart: start-up is not
throughput), then consumes batches, epoch after epoch, until its budget (batches or
seconds) is spent, optionally spending ``step_s`` per batch as the training step would;
it times the consumer's wait in ``next()`` itself and reads the workers' busy time
(``busy_total_s`` of ``Loader.stats()``) before and after, over exactly the measured window. It also reads how long
the workers were on a CPU and how long they waited for one (``/proc/<pid>/schedstat``, as
the autotuner does), and the training process's own CPU time (its step with ``step_mode="busy"``,
the coordinator): workers that wait in the run queue for more than a quarter of their busy
time while the bench's own processes need no more than the CPUs (``contended_by_others``) are
*contended*, other processes hold the CPUs, and the figures are not to be trusted.
:func:`combine` makes one ``Setting`` of repeated measurements: the median run, with the
spread of samples/s. :func:`recommend` picks the smallest worker count whose
best repeat comes within ``within`` of the best median throughput (so that noise between
runs does not move the advice), never more workers than CPUs unless the workers wait on
I/O, and says why more would not help, its advice following one diagnosis (CPU-bound,
I/O-bound, limited by the training process or its step).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .._ext import CONTENDED, cpu_budget, schedstat_seconds

MiB = 2**20


@dataclass
class Setting:
    """What one worker count achieved (the JSON ``settings`` entries: docs/benchmarks.md#json)."""

    workers: int
    batches: int  # batches consumed in the measured window (after the first batch)
    samples: int
    seconds: float  # length of the measured window
    samples_per_s: float
    batches_per_s: float
    mb_per_s: float  # array bytes delivered, 10**6 bytes per second
    wait_pct: float  # % of the window the consumer spent waiting in next()
    worker_busy_pct: float | None  # mean over workers of the % of the window spent loading
    worker_cpu_pct: float | None  # mean over workers of their CPU time (user+system) as % of the window
    peak_rss_mib: float | None  # the largest peak RSS of one worker
    total_rss_mib: float | None  # sum over workers of their peak RSS
    first_batch_s: float  # from creating the loader to the first batch in hand
    overflow_batches: int
    stats: dict = field(default_factory=dict)  # loader.stats() at the end of the window
    uss_mib: float | None = None  # the largest private memory (USS) of one worker: the shared ring left out
    worker_runq_pct: float | None = None  # mean over workers of the time runnable but waiting for a CPU
    contended: bool = (
        False  # workers waited for a CPU > CONTENDED of their busy time, held by others (contended_by_others)
    )
    repeats: int = 1  # measurements combined (combine())
    samples_per_s_min: float | None = None  # the spread of samples/s over the repeats
    samples_per_s_max: float | None = None
    trainer_cpu_pct: float | None = None  # the training process's CPU time (step, coordinator) as % of the window

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def default_worker_counts(cpus: int | None = None) -> list[int]:
    """0, 1, 2, ... up to twice the CPU count (every count up to 8, then about x1.5 steps)."""
    cpus = cpus or cpu_count()
    top = 2 * cpus
    counts = list(range(min(top, 8) + 1))
    w = 8
    while w < top:
        w = min(top, math.ceil(w * 1.5))
        counts.append(w)
    for extra in (cpus, top):
        if extra not in counts:
            counts.append(extra)
    return sorted(set(counts))


def cpu_count() -> int:
    """The CPUs this process may really use: affinity and cgroup quota (``_core/cpus.py``)."""
    return cpu_budget()


def contended_by_others(busy_s: float, runq_s: float, own_cpus: float, cpus: int, seconds: float) -> bool:
    """Whether the workers' waits for a CPU (``runq_s`` in all, against ``busy_s`` of work, over a
    window of ``seconds``) mean that *other* processes held the CPUs: they waited more than
    ``CONTENDED`` of their busy time, while the bench's own processes (``own_cpus``: the CPU time
    of the workers and of the training process, its ``busy`` step and the coordinator, per second)
    left CPUs unused, by more than that margin. Workers that queue behind each other or behind the
    modelled step keep the CPUs busy with the bench's own work: that is not contention. (Counting
    processes instead, 2 workers beside a sleeping step on 2 CPUs would never be contended, though
    they waited 75 % of the time for CPUs they did not use.)"""
    if busy_s <= 0 or runq_s <= CONTENDED * busy_s:
        return False
    return own_cpus < cpus - CONTENDED * busy_s / seconds


def array_bytes(batch: Any) -> int:
    """The bytes of the arrays and tensors in a batch as the consumer holds it (dicts, lists and
    tuples walked): what MB/s counts, the same way at every worker count (0 included, where no
    ring slot is filled, and through an adapter such as the torch facade)."""
    if isinstance(batch, dict):
        return sum(array_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(array_bytes(v) for v in batch)
    nbytes = getattr(batch, "nbytes", None)  # numpy arrays, torch tensors
    return nbytes if isinstance(nbytes, int) else 0


def _step(seconds: float, mode: str) -> None:
    if seconds <= 0:
        return
    if mode == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _live_rss(pids: list[int]) -> dict[int, int]:
    import psutil

    out = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return out


def _cpu_seconds(pids: list[int]) -> dict[int, float]:
    import psutil

    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def _uss(pids: list[int]) -> dict[int, int]:
    """Private memory of each process (pages no other process maps: not the shared ring)."""
    import psutil

    out = {}
    for pid in pids:
        try:
            out[pid] = psutil.Process(pid).memory_full_info().uss
        except (psutil.Error, AttributeError):
            pass
    return out


def _schedstats(pids: list[int]) -> dict[int, tuple[float, float]]:
    return {pid: got for pid in pids if (got := schedstat_seconds(pid)) is not None}


def _busy_totals(stats: dict) -> dict[int, float]:
    """Each worker's busy seconds since it started (``busy_s`` alone is the current epoch's)."""
    return {w["index"]: w.get("busy_total_s", w["busy_s"]) for w in stats["per_worker"]}


def _pids(stats: dict) -> list[int]:
    return [w["pid"] for w in stats["per_worker"] if w["pid"] is not None]


def measure(
    make_loader: Callable[[int], Any],
    workers: int,
    *,
    step_s: float = 0.0,
    step_mode: str = "sleep",
    max_batches: int | None = None,
    max_seconds: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> Setting:
    """Consume ``make_loader(workers)``'s batches, epoch after epoch, until ``max_batches`` or
    ``max_seconds`` is spent (neither: one epoch), and return what it achieved."""
    t0 = time.perf_counter()
    loader = make_loader(workers)
    try:
        it = iter(loader)
        try:
            batch = next(it)
        except StopIteration:
            raise ValueError("the pipeline produced no batch: is the dataset empty?") from None
        first_batch_s = time.perf_counter() - t0
        _step(step_s, step_mode)
        del batch
        s0 = loader.stats()
        cpu0 = _cpu_seconds(_pids(s0))
        sched0 = _schedstats(_pids(s0))
        busy0 = _busy_totals(s0)
        trainer0 = time.process_time()
        start = time.perf_counter()
        deadline = start + max_seconds if max_seconds else math.inf
        endless = max_batches is None and max_seconds is None  # (then: the rest of the first epoch)
        consumed = pending = delivered = 0
        waited = 0.0
        report_at = start + 0.2
        while True:
            before = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                if endless:
                    break
                it = iter(loader)  # the next epoch: the budget, not the epoch, ends the window
                try:
                    batch = next(it)
                except StopIteration:
                    break
            now = time.perf_counter()
            waited += now - before
            consumed += 1
            delivered += array_bytes(batch)
            _step(step_s, step_mode)
            del batch
            pending += 1
            now = time.perf_counter()
            if progress is not None and now >= report_at:
                progress(pending)
                pending = 0
                report_at = now + 0.2
            if max_batches is not None and consumed >= max_batches:
                break
            if now >= deadline:
                break
        end = time.perf_counter()
        trainer_s = time.process_time() - trainer0
        s1 = loader.stats()
        cpu1 = _cpu_seconds(_pids(s1))
        sched1 = _schedstats(_pids(s1))
        rss_now = _live_rss(_pids(s1))
        uss_now = _uss(_pids(s1))
    finally:
        loader.close()
    if progress is not None and pending:
        progress(pending)
    seconds = max(end - start, 1e-9)
    per_batch_samples = s1["samples"] / s1["batches"] if s1["batches"] else 0.0
    samples = round(consumed * per_batch_samples)
    wait = min(1.0, max(0.0, waited / seconds))
    busy_pct = cpu_pct = peak = total = uss = runq_pct = None
    contended = False
    if s1["per_worker"]:
        busy1 = _busy_totals(s1)
        busy = [min(1.0, max(0.0, (busy1[i] - busy0.get(i, 0.0)) / seconds)) for i in busy1]
        busy_pct = 100.0 * sum(busy) / len(busy)
        cpu = [max(0.0, cpu1[p] - cpu0[p]) / seconds for p in cpu1 if p in cpu0]  # restarted workers left out
        cpu_pct = 100.0 * sum(cpu) / len(cpu) if cpu else None
        peaks = [max(w["peak_rss_bytes"], rss_now.get(w["pid"], 0)) for w in s1["per_worker"]]
        peak, total = max(peaks) / MiB, sum(peaks) / MiB
        uss = max(uss_now.values()) / MiB if uss_now else None
        runq = [max(0.0, sched1[p][1] - sched0[p][1]) for p in sched1 if p in sched0]
        if runq:
            runq_pct = 100.0 * sum(runq) / len(runq) / seconds
            own = sum(cpu) + trainer_s / seconds
            contended = contended_by_others(sum(busy) * seconds, sum(runq), own, cpu_count(), seconds)
    return Setting(
        workers=workers,
        batches=consumed,
        samples=samples,
        seconds=seconds,
        samples_per_s=samples / seconds,
        batches_per_s=consumed / seconds,
        mb_per_s=delivered / seconds / 1e6,
        wait_pct=100.0 * wait,
        worker_busy_pct=busy_pct,
        worker_cpu_pct=cpu_pct,
        peak_rss_mib=peak,
        total_rss_mib=total,
        first_batch_s=first_batch_s,
        overflow_batches=s1["overflow_batches"],
        stats=s1,
        uss_mib=uss,
        worker_runq_pct=runq_pct,
        contended=contended,
        samples_per_s_min=samples / seconds,
        samples_per_s_max=samples / seconds,
        trainer_cpu_pct=100.0 * trainer_s / seconds,
    )


def combine(runs: list[Setting]) -> Setting:
    """Repeated measurements of one worker count as one ``Setting``: the run with the median
    samples/s (the lower middle one for an even count), with the spread of all of them;
    ``contended`` if any run was."""
    ordered = sorted(runs, key=lambda s: s.samples_per_s)
    median = ordered[(len(ordered) - 1) // 2]
    rates = [s.samples_per_s for s in ordered]
    return replace(
        median,
        repeats=len(runs),
        samples_per_s_min=rates[0],
        samples_per_s_max=rates[-1],
        contended=any(s.contended for s in runs),
    )


def spread(setting: Setting) -> float:
    """The relative spread of a setting's samples/s over its repeats ((max - min) / median)."""
    if setting.samples_per_s <= 0 or setting.samples_per_s_min is None or setting.samples_per_s_max is None:
        return 0.0
    return (setting.samples_per_s_max - setting.samples_per_s_min) / setting.samples_per_s


def recommend(
    settings: list[Setting], *, within: float = 0.95, step_s: float = 0.0, cpus: int | None = None
) -> dict[str, Any]:
    """The smallest worker count reaching ``within`` of the best samples/s, and why.

    Returns ``{"workers", "fraction_of_best", "best_workers", "best_samples_per_s",
    "gain_beyond", "diagnosis", "contended", "text", "why"}``; ``gain_beyond`` is the
    largest relative gain any larger worker count showed (None when none was measured);
    ``diagnosis`` is one of ``inline``, ``step``, ``io``, ``cpu``, ``consumer``,
    ``growing``, ``flat``, and both ``text`` and ``why`` follow it, so the advice never
    contradicts itself (no "try more workers" beside "CPU-bound"). ``contended``: some
    measurement found the CPUs held by other processes (``why`` then says so).
    """
    cpus = cpus or cpu_count()
    best = max(settings, key=lambda s: s.samples_per_s)
    contended = any(s.contended for s in settings)
    if best.samples_per_s <= 0:
        return {
            "workers": best.workers,
            "fraction_of_best": 1.0,
            "best_workers": best.workers,
            "best_samples_per_s": 0.0,
            "gain_beyond": None,
            "diagnosis": "flat",
            "contended": contended,
            "text": "no throughput measured",
            "why": "every setting delivered nothing",
        }
    # Good enough: its best repeat comes within ``within`` of the best median (noise between runs
    # does not move the advice). Not more workers than CPUs unless they wait on I/O: CPU-bound
    # workers beyond the CPU count only share the same cores (a gain there is noise, or CPU time
    # won from other processes).
    io_bound = any(_diagnose(s, step_s, cpus, largest=False)[0] == "io" for s in settings if s.workers)
    capped = [s for s in settings if s.workers <= cpus] if not io_bound else settings
    good = [s for s in capped or settings if (s.samples_per_s_max or s.samples_per_s) >= within * best.samples_per_s]
    rec = min(good or [max(capped, key=lambda s: s.samples_per_s)], key=lambda s: s.workers)
    frac = rec.samples_per_s / best.samples_per_s
    beyond = [s for s in settings if s.workers > rec.workers]
    gain = max((s.samples_per_s / rec.samples_per_s - 1.0 for s in beyond), default=None)
    diagnosis, why = _diagnose(rec, step_s, cpus, largest=gain is None, best=best)
    noun = "worker" if rec.workers == 1 else "workers"
    text = f"use {rec.workers} {noun}: {frac * 100:.0f} % of the best throughput"
    if best is not rec:
        text += f" ({best.samples_per_s:,.0f} samples/s with {best.workers})"
    if frac < within:  # chosen by its best run: say so, as the table's spread shows it
        text += f", {_best_run(rec) / best.samples_per_s * 100:.0f} % in its best run (within the noise)"
    if gain is not None and gain > 1.0 - within and not io_bound and best.workers > cpus >= rec.workers:
        text += (
            f"; more workers than the {cpus} CPUs measured up to {gain * 100:+.0f} %, which a CPU-bound "
            "pipeline cannot gain (CPU time won from other processes, or noise): not more than the CPUs"
        )
    elif gain is not None:
        if gain <= 0.0:
            text += "; beyond that, no gain: more workers were slower"
        elif gain <= 1.0 - within:
            text += f"; beyond that, no gain (at most {gain * 100:+.0f} %)"
        else:
            text += f"; beyond that, at most {gain * 100:+.0f} %, not worth the extra processes"
    elif diagnosis == "cpu" and _cpus_used(rec) >= 0.9 * cpus:
        text += (
            f"; it is the largest count measured, but its workers already keep the {cpus} CPUs busy: "
            "more would share them (it beat fewer workers by winning CPU time from other processes)"
        )
    elif diagnosis == "cpu":
        text += "; it is the largest count measured, but the pipeline is CPU-bound: more would share the same CPUs"
    elif diagnosis in ("io", "growing"):
        text += "; it is the largest count measured: try more workers, throughput may still grow"
    else:
        text += "; it is the largest count measured, and more workers would not help (see why)"
    if contended:
        worst = max((s.worker_runq_pct or 0.0) for s in settings if s.contended)  # (not waits behind our own)
        why += (
            f". Caution: the CPUs were contended (workers waited up to {worst:.0f} % of the time for a CPU "
            "held by other processes), so these figures vary from run to run; measure on an idle machine "
            "to trust them"
        )
    return {
        "workers": rec.workers,
        "fraction_of_best": frac,
        "best_workers": best.workers,
        "best_samples_per_s": best.samples_per_s,
        "gain_beyond": gain,
        "diagnosis": diagnosis,
        "contended": contended,
        "text": text,
        "why": why,
    }


def _cpus_used(setting: Setting) -> float:
    """How many CPUs the setting's workers kept busy (mean CPU % per worker x workers)."""
    return (setting.worker_cpu_pct or 0.0) * setting.workers / 100.0


def _best_run(setting: Setting) -> float:
    """A setting's samples/s in its best repeat."""
    return setting.samples_per_s_max or setting.samples_per_s


def _diagnose(rec: Setting, step_s: float, cpus: int, largest: bool, best: Setting | None = None) -> tuple[str, str]:
    """What limits the recommended setting: ``(kind, explanation)`` (kinds: ``recommend``); ``best``:
    the setting of the best throughput, which the explanation of ``workers=0`` compares against."""
    busy = rec.worker_busy_pct
    cpu = rec.worker_cpu_pct
    runq = rec.worker_runq_pct or 0.0
    wait = rec.wait_pct
    used = _cpus_used(rec)
    # Waiting for a CPU held by another process is not waiting on I/O: count it as CPU demand.
    waits_on_io = (
        busy is not None and cpu is not None and busy >= 50.0 and cpu + runq < 0.5 * busy and used < 0.5 * cpus
    )
    if rec.workers == 0:
        if best is None or best.samples_per_s <= rec.samples_per_s:
            return "inline", (
                "loading in the training process is at least as fast as with workers: the per-batch "
                "work is too small to pay for handing batches between processes (or the step leaves "
                "no CPU for them)"
            )
        noun = "worker" if best.workers == 1 else "workers"
        return "inline", (
            f"loading in the training process reached {rec.samples_per_s / best.samples_per_s * 100:.0f} % of "
            f"the best median ({best.samples_per_s:,.0f} samples/s with {best.workers} {noun}) and "
            f"{_best_run(rec) / best.samples_per_s * 100:.0f} % in its best run: within the noise between runs, "
            "workers gained too little to pay for handing batches between processes (measure with more "
            "--repeat to separate them)"
        )
    if step_s > 0 and wait < 5.0:
        mem = f" and about {rec.uss_mib:.0f} MiB" if rec.uss_mib else ""
        return "step", (
            f"with {rec.workers} the training loop waits only {wait:.1f} % of the time: the input "
            f"pipeline keeps up with the {step_s * 1e3:g} ms step, so more workers would only cost "
            f"CPU{mem} each"
        )
    if waits_on_io:
        more = f" and more than the {cpus} CPUs help" if rec.workers > cpus else ""
        return "io", (
            f"the workers are {busy:.0f} % busy but use only {cpu:.0f} % of a CPU each: samples wait "
            f"(I/O, sleep) more than they compute, so workers overlap the waits{more}"
        )
    if cpu is not None and (cpu + runq >= 60.0 or used >= 0.6 * cpus):
        return "cpu", (
            f"the workers use {cpu:.0f} % of a CPU each ({used:.1f} of the {cpus} CPUs, which the "
            f"training process shares): the pipeline is CPU-bound, more processes would share the "
            f"same cores"
        )
    if busy is not None and wait >= 20.0 and busy < 60.0:
        return "consumer", (
            f"the training loop waits {wait:.0f} % of the time while the workers are idle "
            f"{100 - busy:.0f} % of it: the limit is in the training process (receiving batches, "
            "the loader's per-batch cost, or the step), not in the workers, so more workers "
            "cannot help"
        )
    figures = (
        f"training loop waits {wait:.0f} %, workers {busy if busy is not None else 0:.0f} % busy, "
        f"{cpu if cpu is not None else 0:.0f} % CPU"
    )
    if largest:
        return "growing", f"throughput was still growing at {rec.workers}, the largest count measured ({figures})"
    return "flat", f"throughput stops growing after {rec.workers} ({figures})"


# ------------------------------------------------------------------------------ output
def format_table(settings: list[Setting]) -> str:
    best = max((s.samples_per_s for s in settings), default=0.0) or 1.0
    head = (
        "workers",
        "samples/s",
        "spread",
        "batches/s",
        "MB/s",
        "wait %",
        "busy %",
        "CPU %",
        "runq %",
        "USS MiB/worker",
        "first batch s",
        "vs best",
    )
    rows = [head]
    rows.extend(
        (
            str(s.workers),
            f"{s.samples_per_s:,.0f}",
            f"±{50 * spread(s):.0f} %" if s.repeats > 1 else "-",
            f"{s.batches_per_s:,.0f}",
            f"{s.mb_per_s:,.1f}",
            f"{s.wait_pct:.1f}",
            "-" if s.worker_busy_pct is None else f"{s.worker_busy_pct:.1f}",
            "-" if s.worker_cpu_pct is None else f"{s.worker_cpu_pct:.0f}",
            "-" if s.worker_runq_pct is None else f"{s.worker_runq_pct:.0f}" + ("!" if s.contended else ""),
            "-" if s.uss_mib is None else f"{s.uss_mib:.0f}",
            f"{s.first_batch_s:.3f}",
            f"{100 * s.samples_per_s / best:.0f} %",
        )
        for s in settings
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
