"""Counters for ``Loader.stats()``: cheap enough to be always on.

The coordinator thread and the consumer each update their own fields (plain int/float
additions under the GIL); ``snapshot`` turns them into the documented dict (the keys are
documented on ``Loader.stats``). Nothing here runs per sample; per batch the engine does
a few additions and ``array_bytes`` (a walk over the batch's layout, well under a
microsecond for a flat batch).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .collate import ARRAY, INLINE


@dataclass
class WorkerCounters:
    tasks: int = 0
    busy_s: float = 0.0
    restarts: int = 0
    rss_bytes: int = 0
    peak_rss_bytes: int = 0


@dataclass
class EpochCounters:
    epoch: int = 0
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    bytes_in_slots: int = 0
    bytes_inline: int = 0
    overflow_batches: int = 0
    redispatched_tasks: int = 0
    worker_deaths: int = 0
    array_bytes: int = 0  # sum of .nbytes of the arrays of every batch delivered
    peak_slots_in_use: int = 0  # most ring slots leased or being filled at once
    worker_base: list = field(default_factory=list)  # (tasks, busy_s) per worker when the epoch started
    skipped: list = field(default_factory=list)  # indices left out by on_error="skip", in the order met
    speculative_tasks: int = 0  # extra attempts of straggling batches (speculate=...)
    timed_out_tasks: int = 0  # attempts killed after task_timeout
    ring_growths: int = 0  # new, larger rings made this epoch (a batch outgrew its slot)
    ring_growth_s: float = 0.0  # coordinator-thread seconds spent making them (file, mapping, page population)


_itemsize: dict[str, int] = {}


def array_bytes(node: list) -> int:
    """Bytes of array data in a batch layout (``collate``): ``.nbytes`` of each array, no padding."""
    kind = node[0]
    if kind == ARRAY:
        size = _itemsize.get(node[1])
        if size is None:
            size = _itemsize[node[1]] = np.dtype(node[1]).itemsize
        return size * math.prod(node[2])
    if kind == INLINE:
        value = node[1]
        return value.nbytes if isinstance(value, np.ndarray) else 0
    total = 0
    for child in node[2]:
        total += array_bytes(child)
    return total


def worker_baseline(workers: list[WorkerCounters]) -> list[tuple[int, float]]:
    """What each worker had done before an epoch started (to report per-epoch figures)."""
    return [(c.tasks, c.busy_s) for c in workers]


def _fraction(part: float, whole: float) -> float:
    if whole <= 0.0:
        return 0.0
    return min(1.0, max(0.0, part / whole))


def snapshot(
    counters: EpochCounters | None,
    *,
    workers: int,
    running: bool,
    consumed: int | None,
    ring: Any = None,
    worker_counters: list[WorkerCounters] | None = None,
    pids: list[int | None] | None = None,
) -> dict[str, Any]:
    """The dict ``Loader.stats()`` returns; see that method for every key.

    ``counters``: the current or last epoch's counters (None before the first epoch);
    ``running``: whether that epoch's iterator is still live; ``consumed``: batches the
    consumer took (None: the same as delivered); ``ring``: the coordinator's ``Ring`` or
    None; ``worker_counters``/``pids``: one entry per worker.
    """
    now = time.perf_counter()
    c = counters if counters is not None else EpochCounters(started=now)
    end = now if running or c.ended is None else c.ended
    wall = max(0.0, end - c.started)
    batches = c.batches
    out: dict[str, Any] = {
        "epoch": counters.epoch if counters is not None else None,
        "running": bool(running and counters is not None),
        "workers": workers,
        "wall_s": wall,
        "batches": batches,
        "samples": c.samples,
        "batches_consumed": batches if consumed is None else min(consumed, batches),
        "batches_per_s": batches / wall if wall > 0 else 0.0,
        "samples_per_s": c.samples / wall if wall > 0 else 0.0,
        "wait_s": c.wait_s,
        "wait_fraction": _fraction(c.wait_s, wall),
        "bytes": c.array_bytes,
        "bytes_per_s": c.array_bytes / wall if wall > 0 else 0.0,
        "bytes_in_slots": c.bytes_in_slots,
        "bytes_inline": c.bytes_inline,
        "overflow_batches": c.overflow_batches,
        "redispatched_tasks": c.redispatched_tasks,
        "worker_deaths": c.worker_deaths,
        "skipped": list(c.skipped),
        "speculative_tasks": c.speculative_tasks,
        "timed_out_tasks": c.timed_out_tasks,
        "ring_growths": c.ring_growths,
        "ring_growth_s": c.ring_growth_s,
    }
    if ring is not None:
        in_use = ring.slots - len(ring.free)
        out.update(
            ring_slots=ring.slots,
            ring_slot_bytes=ring.slot_bytes,
            ring_slots_in_use=in_use,
            ring_peak_slots_in_use=c.peak_slots_in_use,
            ring_occupancy=_fraction(in_use, ring.slots),
            ring_peak_occupancy=_fraction(c.peak_slots_in_use, ring.slots),
        )
    else:
        out.update(
            ring_slots=0,
            ring_slot_bytes=0,
            ring_slots_in_use=0,
            ring_peak_slots_in_use=0,
            ring_occupancy=0.0,
            ring_peak_occupancy=0.0,
        )
    per_worker = []
    worker_counters = worker_counters or []
    base = c.worker_base
    for i, w in enumerate(worker_counters):
        if i < len(base):
            tasks0, busy0 = base[i]
        elif base:  # a worker added (autotune) after the epoch began
            tasks0, busy0 = 0, 0.0
        else:  # the epoch has not begun in the coordinator yet
            tasks0, busy0 = w.tasks, w.busy_s
        busy = max(0.0, w.busy_s - busy0)
        pid = pids[i] if pids is not None and i < len(pids) else None
        if pids is not None and pid is None and w.tasks == tasks0:
            continue  # no process at this index now (autotune retired it) and no work this epoch
        per_worker.append(
            {
                "index": i,
                "pid": pid,
                "tasks": w.tasks - tasks0,
                "busy_s": busy,
                "busy_fraction": _fraction(busy, wall),
                "tasks_total": w.tasks,
                "busy_total_s": w.busy_s,  # since the worker's index started (across epochs: the bench's windows)
                "restarts": w.restarts,
                "rss_bytes": w.rss_bytes,
                "peak_rss_bytes": w.peak_rss_bytes,
            }
        )
    out["per_worker"] = per_worker
    out["worker_busy_fraction"] = sum(w["busy_fraction"] for w in per_worker) / len(per_worker) if per_worker else 0.0
    out["worker_tasks"] = sum(w["tasks"] for w in per_worker)
    out["worker_peak_rss_bytes"] = max((w["peak_rss_bytes"] for w in per_worker), default=0)
    return out
