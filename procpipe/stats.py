"""Counters for ``Loader.stats()``: cheap enough to be always on.

The coordinator thread and the consumer each update their own fields (plain int/float
additions under the GIL); ``snapshot`` turns them into the documented dict.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


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
