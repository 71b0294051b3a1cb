"""The node file auto-tuned loaders share (``procpipe._core.nodeshare``): shares, safety, cleanup."""

from __future__ import annotations

import fcntl
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest

from procpipe._core import nodeshare, stale_files
from procpipe._core.nodeshare import NodeShare, water_fill


def only_file(directory) -> str:
    names = os.listdir(directory)
    assert len(names) == 1 and nodeshare.NAME.match(names[0]), names
    return os.path.join(directory, names[0])


def test_water_fill_gives_each_what_it_wants_and_splits_the_rest():
    assert water_fill(16, {"a": math.inf, "b": math.inf}) == {"a": 8, "b": 8}
    assert water_fill(16, {"a": math.inf, "b": 2.0, "c": 0.0}) == {"a": 14, "b": 2.0, "c": 0.0}
    assert water_fill(16, {"a": 10.0, "b": 10.0}) == {"a": 8, "b": 8}


def test_loaders_share_the_budget_and_the_last_one_out_removes_the_file(tmp_path):
    a, b = NodeShare(str(tmp_path), 16, key="a"), NodeShare(str(tmp_path), 16, key="b")
    assert a.update(math.inf) == 16  # alone: the whole budget
    assert b.update(math.inf) == 8
    assert a.update(math.inf) == 8 and a.peers == 2
    path = only_file(tmp_path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    b.update(0.0)  # b is between iterations (a validation loader waiting its turn)
    assert a.update(math.inf) == 16
    a.leave()
    assert os.path.exists(path)
    b.leave()
    assert os.listdir(tmp_path) == []


def test_a_busy_lock_is_not_waited_for(tmp_path):
    a, b = NodeShare(str(tmp_path), 16, key="a"), NodeShare(str(tmp_path), 16, key="b")
    a.update(math.inf)
    b.update(math.inf)
    assert a.update(math.inf) == 8
    fd = os.open(only_file(tmp_path), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        t = time.perf_counter()
        assert a.update(0.0) == 8  # the last share stands
        assert time.perf_counter() - t < 0.5
    finally:
        os.close(fd)
    assert a.update(0.0) == 1.0 and b.update(math.inf) == 16
    a.leave()
    b.leave()


def test_lines_of_dead_processes_and_stale_heartbeats_are_dropped(tmp_path):
    a = NodeShare(str(tmp_path), 16, key="a")
    a.update(math.inf)
    path = only_file(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    now = time.time()
    with open(path, "a") as f:
        f.write(f"dead {int(dead.stdout)} {now:.3f} inf\n")  # its process is gone
        f.write(f"stale {os.getpid()} {now - 2 * nodeshare.STALE_S:.3f} inf\n")  # no heartbeat for 20 s
        f.write("garbage line\n")
    assert a.update(math.inf) == 16 and a.peers == 1
    with open(path) as f:
        assert [line.split()[0] for line in f] == ["a"]
    a.leave()
    assert os.listdir(tmp_path) == []


def test_a_symlink_or_someone_elses_file_is_refused(tmp_path, caplog):
    target = tmp_path / "elsewhere"
    target.write_text("")
    name = nodeshare.file_name(16)
    os.symlink(target, tmp_path / name)
    a = NodeShare(str(tmp_path), 16, key="a")
    assert a.update(math.inf) == 16  # works alone
    assert "will not share this node's CPUs" in caplog.text
    assert target.read_text() == ""
    a.leave()
    os.unlink(tmp_path / name)
    (tmp_path / name).write_text("")
    os.chmod(tmp_path / name, 0o644)  # readable by others: not one procpipe made
    b = NodeShare(str(tmp_path), 16, key="b")
    assert b.update(math.inf) == 16
    assert (tmp_path / name).read_text() == ""
    b.leave()


def test_a_removed_file_is_made_again_at_the_next_heartbeat(tmp_path):
    a, b = NodeShare(str(tmp_path), 16, key="a"), NodeShare(str(tmp_path), 16, key="b")
    a.update(math.inf)
    b.update(math.inf)
    os.unlink(only_file(tmp_path))  # (the sweep or the reaper of a killed process)
    assert a.update(math.inf) == 16
    assert b.update(math.inf) == 8 and a.update(math.inf) == 8
    a.leave()
    b.leave()
    assert os.listdir(tmp_path) == []


def test_the_sweep_removes_a_node_file_no_live_loader_uses(tmp_path):
    a = NodeShare(str(tmp_path), 16, key="a")
    a.update(math.inf, now=time.time() - 3 * nodeshare.STALE_S)  # its only line is stale
    path = only_file(tmp_path)
    old = time.time() - 3 * nodeshare.STALE_S
    os.utime(path, (old, old))
    swept = stale_files.sweep(str(tmp_path))
    assert swept.paths == [path] and os.listdir(tmp_path) == []
    a.leave()


def test_the_sweep_keeps_a_node_file_in_use(tmp_path):
    a = NodeShare(str(tmp_path), 16, key="a")
    a.update(math.inf)
    path = only_file(tmp_path)
    old = time.time() - 3 * nodeshare.STALE_S
    os.utime(path, (old, old))  # (unchanged for a while, but its line is fresh: kept)
    assert stale_files.sweep(str(tmp_path)).paths == [] and os.path.exists(path)
    a.leave()
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(60)
def test_the_reaper_removes_a_killed_process_lines_and_the_file_when_it_was_the_last(tmp_path):
    code = textwrap.dedent(f"""
        import math, os, sys, time
        from procpipe._core.nodeshare import NodeShare
        share = NodeShare({str(tmp_path)!r}, 16, key="child")
        share.update(math.inf)
        print("ready", flush=True)
        time.sleep(60)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "ready"
        path = only_file(tmp_path)
        mine = NodeShare(str(tmp_path), 16, key="mine")
        assert mine.update(math.inf) == 8
        child.kill()
        child.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with open(path) as f:
                if [line.split()[0] for line in f] == ["mine"]:
                    break
            time.sleep(0.05)
        else:
            pytest.fail("the reaper did not remove the killed process's line")
        mine.leave()
    finally:
        child.kill()
        child.wait()
    assert os.listdir(tmp_path) == []
    # alone, killed: the reaper removes the file
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "ready"
        only_file(tmp_path)
        child.kill()
        child.wait()
        deadline = time.monotonic() + 20
        while os.listdir(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.listdir(tmp_path) == []
    finally:
        child.kill()
        child.wait()
