"""Where this process's cgroup limits are read: its cgroup directories, its own and its ancestors'.

A limit set on a container (``docker run --cpus``/``--memory``, a Kubernetes pod's limits, a
Slurm job) is a value in a file of the process's cgroup, or of an ancestor's: the smallest
applies. ``cgroup_dirs(controller)`` lists those directories, the process's own first:

- cgroup v2: one unified hierarchy; ``/proc/self/cgroup`` says ``0::<path>``;
- cgroup v1: one hierarchy per controller (``cpu``, ``memory``...); ``/proc/self/cgroup`` says
  ``<id>:<controllers>:<path>`` for the hierarchy holding ``controller``.

Where each hierarchy is mounted comes from ``/proc/self/mountinfo`` (usually ``/sys/fs/cgroup``).
Inside a container with a cgroup namespace the process sees itself at the root (``0::/``), and
the container's limit is in the mount's own files, which are read then. Anything missing or
unreadable means "no limit from there". Every path is read under ``root``, so the tests point it
at a fake tree. Readers: ``cpus.py`` (the CPU quota), ``memory_budget.py`` (the memory limit).
"""

from __future__ import annotations

import os

__all__ = ["cgroup_dirs", "read_text"]

_V1_FALLBACK_MOUNTS = {  # the usual v1 mount points, where mountinfo names none
    "cpu": ("/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpu"),
    "memory": ("/sys/fs/cgroup/memory",),
}


def read_text(path: str) -> str | None:
    """The file's text, or None if it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _mounts(root: str) -> list[tuple[str, str, str, str]]:
    """``(fstype, mount root, mount point, super options)`` of the cgroup mounts in ``mountinfo``."""
    text = read_text(os.path.join(root, "proc/self/mountinfo")) or ""
    found = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 1 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        found.append((tail[0], fields[3], fields[4], tail[2] if len(tail) > 2 else ""))
    return found


def _up_from(base: str, path: str) -> list[str]:
    """The directory of cgroup ``path`` under ``base`` (its mount point), then each ancestor up to ``base``."""
    dirs = []
    rel = "/" + path.strip("/")
    while True:
        dirs.append(os.path.join(base, rel.lstrip("/")) if rel != "/" else base)
        if rel == "/":
            return dirs
        rel = os.path.dirname(rel)


def cgroup_dirs(controller: str, root: str = "/") -> list[tuple[str, list[str]]]:
    """``(version, [directories: the process's own cgroup first, then its ancestors])`` for each
    hierarchy that may hold ``controller``'s limits (``"v1"`` or ``"v2"``)."""
    text = read_text(os.path.join(root, "proc/self/cgroup")) or ""
    mounts = _mounts(root)
    out: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            version, points = "v2", [(r, p) for t, r, p, _ in mounts if t == "cgroup2"] or [("/", "/sys/fs/cgroup")]
        elif controller in controllers.split(","):
            version = "v1"
            points = [(r, p) for t, r, p, o in mounts if t == "cgroup" and controller in o.split(",")]
            points = points or [("/", p) for p in _V1_FALLBACK_MOUNTS.get(controller, ())]
        else:
            continue
        for mount_root, mount_point in points:
            rel = path
            if mount_root != "/" and (rel == mount_root or rel.startswith(mount_root.rstrip("/") + "/")):
                rel = rel[len(mount_root) :]
            out.append((version, _up_from(os.path.join(root, mount_point.lstrip("/")), rel)))
    if not out:  # no /proc/self/cgroup: the usual mount points, as a container sees its own cgroup
        fallback = _V1_FALLBACK_MOUNTS.get(controller, ())[-1:]
        out = [("v2", [os.path.join(root, "sys/fs/cgroup")])]
        out += [("v1", [os.path.join(root, p.lstrip("/"))]) for p in fallback]
    return out
