"""Anonymous shared memory (procpipe._core.shm, _core/memory_budget.py): what limits it, how its
descriptors reach the workers, and what a worker sees.

The container cases (a small ``/dev/shm``, a small memory cgroup, a SIGKILL) are in
test_containers.py; here: the budget read from a cgroup tree (a fake one), the messages, the
descriptors carried with messages on a worker's pipe, and the ring's descriptor reaching workers of
every start method, its growth included.
"""
from __future__ import annotations

import os
import socket
import warnings

import numpy as np
import pytest
from conftest import START_METHODS, loader_token, segments

import procpipe
from procpipe._core import wire
from procpipe._core.memory_budget import MemoryBudget, format_bytes, memory_budget
from procpipe._core.messages import MapRing, Task
from procpipe._core.shm import Segments, check_memory

GIB = 2**30


# --------------------------------------------------------------------------- the memory budget
def _tree(root, cgroup_line, mounts, files):
    """A fake /proc/self/{cgroup,mountinfo} and cgroup files under ``root``."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup_line + "\n")
    (root / "proc/self/mountinfo").write_text("".join(
        f"30 20 0:26 {mount_root} {point} rw - {fs} cgroup rw{',' + options if options else ''}\n"
        for fs, mount_root, point, options in mounts))
    for path, text in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def _budget(root, monkeypatch, available=64 * GIB):
    vm = type("VM", (), {"available": available, "total": 128 * GIB})
    monkeypatch.setattr("procpipe._core.memory_budget.psutil.virtual_memory", lambda: vm)
    return memory_budget(str(root))


def test_the_budget_is_the_smallest_room_of_the_cgroup_and_its_ancestors_v2(tmp_path, monkeypatch):
    base = "/sys/fs/cgroup"
    _tree(tmp_path, "0::/kubepods/pod1/c1", [("cgroup2", "/", base, "")], {
        f"{base}/kubepods/pod1/c1/memory.max": "max\n",  # the container sets none itself
        f"{base}/kubepods/pod1/c1/memory.current": "100\n",
        f"{base}/kubepods/pod1/memory.max": f"{2 * GIB}\n",  # the pod's limit
        f"{base}/kubepods/pod1/memory.current": f"{GIB}\n",
        f"{base}/kubepods/pod1/memory.stat": f"anon 1\ninactive_file {256 * 2**20}\nactive_file 5\n",
        f"{base}/kubepods/memory.max": f"{64 * GIB}\n",
        f"{base}/kubepods/memory.current": f"{GIB}\n",
    })
    budget = _budget(tmp_path, monkeypatch)
    assert budget.available == GIB + 256 * 2**20  # 2 GiB - 1 GiB used + what the kernel reclaims first
    assert budget.total == 2 * GIB
    assert "/sys/fs/cgroup/kubepods/pod1" in budget.limit and "2.00 GiB" in budget.limit


def test_the_budget_reads_cgroup_v1_and_its_no_limit_value(tmp_path, monkeypatch):
    base = "/sys/fs/cgroup/memory"
    _tree(tmp_path, "4:memory:/docker/abc", [("cgroup", "/", base, "memory")], {
        f"{base}/docker/abc/memory.limit_in_bytes": f"{512 * 2**20}\n",
        f"{base}/docker/abc/memory.usage_in_bytes": f"{100 * 2**20}\n",
        f"{base}/docker/abc/memory.stat": "total_inactive_file 0\n",
        f"{base}/docker/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
        f"{base}/docker/memory.usage_in_bytes": "5\n",
    })
    budget = _budget(tmp_path, monkeypatch)
    assert (budget.available, budget.total) == (412 * 2**20, 512 * 2**20)
    assert "/docker/abc" in budget.limit


def test_without_a_cgroup_limit_the_budget_is_available_memory(tmp_path, monkeypatch):
    _tree(tmp_path, "0::/", [("cgroup2", "/", "/sys/fs/cgroup", "")], {"/sys/fs/cgroup/memory.max": "max\n"})
    budget = _budget(tmp_path, monkeypatch, available=3 * GIB)
    assert (budget.available, budget.total) == (3 * GIB, 128 * GIB)
    assert budget.limit.startswith("the machine's available memory")


def test_too_little_memory_is_an_error_naming_the_limit_and_the_fixes(monkeypatch):
    budget = MemoryBudget(100 * 2**20, 512 * 2**20, "the memory limit of this process's cgroup (512.0 MiB at /x)")
    monkeypatch.setattr("procpipe._core.shm.memory_budget", lambda: budget)
    check_memory(90 * 2**20, "a test segment", "use less")  # fits, with 10 % left for the rest
    with pytest.raises(procpipe.SharedMemoryError) as info:
        check_memory(95 * 2**20, "a test segment", "use less")
    message = str(info.value)
    assert message.startswith("procpipe needs 95.0 MiB of memory for a test segment, but the memory limit of this "
                              "process's cgroup (512.0 MiB at /x) leaves 100.0 MiB")
    assert "Fixes: use less; or give the process more memory" in message and "docker run --memory" in message


@pytest.mark.parametrize("n, shown", [(64, "64 bytes"), (1023, "1023 bytes"), (1536, "1.5 KiB"),
                                      (64 * 2**20, "64.0 MiB"), (3 * GIB // 2, "1.50 GiB")])
def test_sizes_are_shown_in_units_a_person_reads(n, shown):
    assert format_bytes(n) == shown  # (before: "0.0 MiB" for 64 bytes)


def test_a_segment_is_anonymous_named_sealed_and_reserved():
    memory = Segments()
    fd = memory.new("ring0", 3 * 4096, "a test ring")
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
        assert target == f"/memfd:{memory.token}ring0 (deleted)" and memory.token.startswith(f"procpipe-{os.getpid()}-")
        assert os.fstat(fd).st_size == 3 * 4096 and os.fstat(fd).st_blocks * 512 >= 3 * 4096  # reserved
        for change in (lambda: os.ftruncate(fd, 4096), lambda: os.ftruncate(fd, 8 * 4096)):
            with pytest.raises(PermissionError):  # its size is fixed: no reader can be cut short (SIGBUS)
                change()
        assert memory.prefix is None and not memory.named
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- descriptors on the pipe
def test_descriptors_travel_with_their_messages_in_order_through_partial_writes():
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # small: every flush writes in part
    conn_out, conn_in = _Conn(ours), _Conn(theirs)
    outbox, inbox = wire.Outbox(conn_out), wire.Inbox(conn_in, with_fds=True)
    memory = Segments()
    sent = []
    for ring in range(6):
        fd = memory.new(f"ring{ring}", 4096, "a test ring")
        os.pwrite(fd, bytes([ring + 1]), 0)
        outbox.put(MapRing(ring, 4096), (fd,))
        os.close(fd)  # (the outbox holds its own copy until it is sent)
        for k in range(20):  # tasks of ~5 KB: more than the socket takes at once
            outbox.put(Task(ring * 100 + k, 0, list(range(1000)), ring, k, 4096))
        sent.append(ring)
    received: list[tuple[int, int]] = []  # (ring id, the first byte of the memory its descriptor holds)
    tasks = 0
    while outbox.pending or not received or len(received) < len(sent) or tasks < 120:
        outbox.flush()
        for data in inbox.receive():
            message = wire.decode(data)
            if type(message) is MapRing:
                fd = inbox.fds.popleft()
                received.append((message.ring_id, os.pread(fd, 1, 0)[0]))
                os.close(fd)
            else:
                assert message.ring_id == received[-1][0]  # its ring arrived before it
                tasks += 1
    assert received == [(ring, ring + 1) for ring in sent] and tasks == 120
    assert not inbox.fds
    outbox.close()
    inbox.close()
    ours.close()
    theirs.close()


class _Conn:
    """The one thing Outbox and Inbox ask of a multiprocess Connection: its descriptor."""

    def __init__(self, sock):
        self._sock = sock

    def fileno(self):
        return self._sock.fileno()


# --------------------------------------------------------------------------- what the workers see
def big(i):
    """Samples of the first 10 batches (4 each) are small; after them, 3x larger (the ring grows)."""
    return np.full(4096 if i < 40 else 3 * 4096, i % 251, np.uint8)


@pytest.mark.parametrize("method", START_METHODS)
def test_every_start_method_maps_the_ring_and_its_growth_by_descriptor(method):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the batches that overflowed before it grew)
        with procpipe.Loader(range(120), big, batch_size=4, workers=2, prefetch=1, start_method=method) as loader:
            token = loader_token(loader)
            got = [b[:, 0].tolist() for b in loader]
            assert loader.stats()["ring_growths"] == 1
            worker_maps = {pid: {n for n in segments(pid) if n.startswith(token)} for pid in loader.worker_pids}
    assert got == [[i % 251 for i in range(k, k + 4)] for k in range(0, 120, 4)]
    for pid, names in worker_maps.items():
        # the grown ring, by descriptor (a memfd: no file name); the first generation let go of
        assert f"{token}ring1" in names and f"{token}ring0" not in names, (pid, names)
        assert f"{token}status" in names, (pid, names)


def small(i):
    return np.full(4096, i % 251, np.uint8)


def test_nothing_of_a_loader_is_in_dev_shm():
    before = set(os.listdir("/dev/shm"))
    with procpipe.Loader(range(64), small, batch_size=8, workers=2, cache=True) as loader:
        assert sum(len(b) for b in loader) == 64
        assert set(os.listdir("/dev/shm")) - before == set()
        assert {n[len(loader_token(loader)):] for n in segments() if n.startswith(loader_token(loader))} >= {
            "ring0", "status", "cache"}
