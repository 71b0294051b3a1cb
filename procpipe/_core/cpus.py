"""The CPU budget this process really has: its affinity, and its cgroup's CPU quota.

``os.cpu_count()`` counts the host's CPUs; a process may run on fewer. Two things limit it,
and :func:`cpu_budget` takes the smaller:

- **Affinity** (``os.sched_getaffinity``: ``taskset``, ``numactl``, a cpuset cgroup,
  Slurm's ``--cpus-per-task`` binding): the CPUs it may be scheduled on.
- **A CPU quota** (a container's ``--cpus``, Kubernetes' CPU limit): the CPU time its
  cgroup may use per period. cgroup v2: ``cpu.max`` holds ``"<quota> <period>"`` in
  microseconds, or ``"max <period>"`` for no limit; cgroup v1: ``cpu.cfs_quota_us``
  (``-1``: no limit) and ``cpu.cfs_period_us``. A quota of ``quota / period`` CPUs counts
  as ``ceil(quota / period)`` (at least 1): with 1.5 CPUs of quota, two CPU-bound workers
  use all of it (0.75 CPU each) where one would leave half a CPU unused. The quota of
  every ancestor cgroup applies too (the smallest wins).

Which cgroup directories hold those files: ``cgroups.py`` (the process's own, then its
ancestors'; the container's own at the root of a cgroup namespace). Anything missing or
unreadable means "no limit from there". Every path is read under ``root``, so the tests
point it at a fake tree.

This is the count ``workers="auto"`` grows to for CPU-bound work, the one the bench's
sweep and advice use, and the one every "more workers than CPUs" message names.
"""

from __future__ import annotations

import math
import os

from .cgroups import cgroup_dirs, read_text

__all__ = ["affinity_count", "cpu_budget", "cpu_quota"]


def affinity_count() -> int:
    """CPUs this process may be scheduled on (its affinity mask; the host's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _quota_v2(directory: str) -> float | None:
    text = read_text(os.path.join(directory, "cpu.max"))
    if text is None:
        return None
    fields = text.split()
    if len(fields) < 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(directory: str) -> float | None:
    quota = read_text(os.path.join(directory, "cpu.cfs_quota_us"))
    period = read_text(os.path.join(directory, "cpu.cfs_period_us"))
    if quota is None or period is None:
        return None
    try:
        q, p = int(quota.strip()), int(period.strip())
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None  # -1: no limit


def cpu_quota(root: str = "/") -> float | None:
    """The CPU quota of this process's cgroup (or an ancestor's, the smallest), in CPUs; None: none.

    ``root``: where ``/proc`` and ``/sys`` are read from (tests pass a fake tree)."""
    found: list[float] = []
    for version, dirs in cgroup_dirs("cpu", root):
        read = _quota_v2 if version == "v2" else _quota_v1
        for d in dirs:
            q = read(d)
            if q is not None:
                found.append(q)
    return min(found) if found else None


def cpu_budget(root: str = "/", affinity: int | None = None) -> int:
    """CPUs this process may really use: the smaller of its affinity and its cgroup quota
    (``ceil(quota / period)``, at least 1). ``affinity``: the count to use instead of
    ``sched_getaffinity`` (tests)."""
    count = affinity_count() if affinity is None else affinity
    quota = cpu_quota(root)
    if quota is not None:
        count = min(count, max(1, math.ceil(quota - 1e-9)))
    return max(1, count)
