"""The memory this process may still take: its memory cgroup's room, and the machine's available RAM.

procpipe's shared memory is anonymous (``memfd_create``, shm.py): no ``/dev/shm`` size limits it,
so what limits it is memory itself. Shared pages are charged to the cgroup of the process that
first touches them (the training process: it reserves every page when it makes a segment), and
past the cgroup's limit the kernel's OOM killer ends a process of the container: the training
process, most often. So before a ring, a cache or ``Records`` is made, what it needs is held
against :func:`memory_budget`, the smaller of

- **the memory cgroup's room**: its limit less what it uses, for the process's own cgroup and
  each ancestor's (the smallest wins): cgroup v2 ``memory.max`` (``"max"``: none) less
  ``memory.current``; cgroup v1 ``memory.limit_in_bytes`` (a value near 2**63: none) less
  ``memory.usage_in_bytes``. The page cache's inactive part (``inactive_file``,
  ``total_inactive_file`` in v1's ``memory.stat``) counts as room: the kernel reclaims it
  before it kills anything. Where the directories are: ``cgroups.py``.
- **the machine's available memory** (``psutil.virtual_memory().available``: free memory and
  what the kernel can reclaim).

``MemoryBudget.limit`` says which one it was, in words a message can show.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import psutil

from .cgroups import cgroup_dirs, read_text

__all__ = ["MemoryBudget", "format_bytes", "memory_budget"]

_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as the largest page-aligned int64 (about 2**63)


class MemoryBudget(NamedTuple):
    """``available``: bytes this process may still take; ``total``: the whole of what limits it (the
    cgroup's limit, or the machine's memory); ``limit``: what sets it, in words."""

    available: int
    total: int
    limit: str


def format_bytes(n: float) -> str:
    """``n`` bytes for a person: ``"512 bytes"``, ``"3.5 KiB"``, ``"64.0 MiB"``, ``"2.00 GiB"``."""
    if n < 1024:
        return f"{int(n)} bytes"
    if n < 1 << 20:
        return f"{n / 1024:.1f} KiB"
    if n < 1 << 30:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**30:.2f} GiB"


def _number(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_field(directory: str, name: str) -> int:
    for line in (read_text(os.path.join(directory, "memory.stat")) or "").splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return _number(value) or 0
    return 0


def _cgroup_room(version: str, directory: str) -> tuple[int, int, int] | None:
    """``(room, limit, used)`` in bytes under ``directory``'s limit, or None where it sets none."""
    if version == "v2":
        limit = _number(read_text(os.path.join(directory, "memory.max")))
        used = _number(read_text(os.path.join(directory, "memory.current")))
        reclaimable = _stat_field(directory, "inactive_file")
    else:
        limit = _number(read_text(os.path.join(directory, "memory.limit_in_bytes")))
        used = _number(read_text(os.path.join(directory, "memory.usage_in_bytes")))
        reclaimable = _stat_field(directory, "total_inactive_file")
    if limit is None or limit >= _NO_LIMIT or used is None:
        return None
    return max(0, limit - used + min(reclaimable, used)), limit, used


def memory_budget(root: str = "/") -> MemoryBudget:
    """What this process may still take (module doc); ``root``: where ``/proc`` and ``/sys`` are
    read from (tests pass a fake tree)."""
    vm = psutil.virtual_memory()
    best = MemoryBudget(
        int(vm.available),
        int(vm.total),
        f"the machine's available memory ({format_bytes(vm.available)} of {format_bytes(vm.total)})",
    )
    for version, dirs in cgroup_dirs("memory", root):
        for directory in dirs:
            found = _cgroup_room(version, directory)
            if found is not None and found[0] < best.available:
                room, limit, used = found
                shown = directory[len(root.rstrip("/")) :] if root != "/" else directory
                best = MemoryBudget(
                    room,
                    limit,
                    f"the memory limit of this process's cgroup ({format_bytes(limit)} at {shown}, "
                    f"{format_bytes(used)} of it in use)",
                )
    return best
