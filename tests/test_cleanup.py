"""Nothing of a loader stays when the training process is SIGKILLed, whatever its workers are
doing: its anonymous shared memory (the default) has no name to leave anywhere, and its files in
an ``shm_dir`` go too (the reaper, procpipe._core.reaper); a loader started later removes what a
dead process left (the sweep, procpipe._core.stale_files), never a live process's file, a symlink
or another user's file.

Each SIGKILL case runs the training process as a subprocess that reports its state on its
stdout (and its workers through marker files); the test waits for that state, kills it, then
polls its shm_dir until it is empty (a few seconds at most).
"""
from __future__ import annotations

import fcntl
import gc
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
from conftest import python_env, segments, wait_gone, wait_until

import procpipe
from procpipe._core import reaper
from procpipe._core.stale_files import SETTLE_S, sweep
from procpipe._engine.pool import LocalWorker

GONE_WITHIN_S = 5.0  # "a few seconds": from the SIGKILL to an empty shm_dir

CHILD = r'''
import os, signal, sys
import numpy as np
import procpipe
from procpipe._core import reaper

state, method, shm_dir, marks = sys.argv[1:5]

def mark(what):
    open(os.path.join(marks, f"{what}-{os.getpid()}"), "w").close()

class Source:
    """Samples 0..31; a worker unpickling it (forkserver, spawn) marks and blocks in state "starting"."""
    def __init__(self, block_start):
        self.block_start = block_start
    def __len__(self):
        return 32
    def __getitem__(self, i):
        return np.full(4, i)
    def __setstate__(self, d):
        self.__dict__.update(d)
        if self.block_start:
            mark("starting")
            signal.pause()

def dies(x):
    mark("dying")
    os._exit(3)

def blocks_after_the_first_batch(x):
    if x[0] >= 4:
        mark("busy")
        signal.pause()
    return x

fn = {"failed": dies, "busy": blocks_after_the_first_batch}.get(state)
# (slot_bytes: the ring is made with the loader, not by its first batch: a file from the start)
loader = procpipe.Loader(Source(state == "starting"), fn, batch_size=4, workers=1 if state == "failed" else 2,
                         max_worker_restarts=0, slot_bytes=4096,
                         prefetch=1, start_method=method, **({} if shm_dir == "-" else {"shm_dir": shm_dir}))
if state == "failed":
    try:
        list(loader)
    except procpipe.WorkerError:
        pass
    print("ready", reaper.reaper_pid(), flush=True)
elif state == "starting":
    print("ready", reaper.reaper_pid(), flush=True)
    next(iter(loader))
else:
    it = iter(loader)
    next(it)
    print("ready", reaper.reaper_pid(), *loader.worker_pids, flush=True)
    if state == "busy":
        next(it)
sys.stdin.read()  # until killed
'''


def _start_child(tmp_path, state, method, shm_dir):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), state, method, shm_dir, str(marks)], env=python_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, marks


def _ready(proc):
    line = proc.stdout.readline().split()
    if not line or line[0] != "ready":
        proc.kill()
        pytest.fail(f"the training process did not start: {line} {proc.stderr.read()}")
    return [None if p == "None" else int(p) for p in line[1:]]


def _marked(marks, what):
    return [int(n.split("-")[1]) for n in os.listdir(marks) if n.startswith(what + "-")]


def _stopped(pids):
    try:
        return all(psutil.Process(p).status() == psutil.STATUS_STOPPED for p in pids)
    except psutil.NoSuchProcess:
        return False


def _kill_and_check(proc, files, others):
    """SIGKILL the training process; its files must be gone within GONE_WITHIN_S, then its reaper too."""
    assert files(), "the loader made no file: nothing to check"
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL
    wait_until(lambda: not files(), GONE_WITHIN_S, "the killed training process's files to be removed")
    assert wait_gone(others, 10) == [], "the reaper (or a worker) outlived the training process"


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_sigkill_after_a_failed_epoch_leaves_nothing(tmp_path, shm_dir, method):
    # (a) every worker died in the epoch (WorkerError, no restart): none is left to clean up
    proc, marks = _start_child(tmp_path, "failed", method, shm_dir)
    try:
        reaper_pid, = _ready(proc)
        dead = _marked(marks, "dying")
        assert len(dead) == 1 and wait_gone(dead, 10) == [], "the loader's only worker is to be dead"
        _kill_and_check(proc, lambda: os.listdir(shm_dir), [reaper_pid])
    finally:
        proc.kill()
        proc.communicate()


def test_sigkill_mid_epoch_with_busy_workers_leaves_nothing(tmp_path, shm_dir):
    # (b) mid-epoch: a batch was returned, both workers are inside fn
    proc, marks = _start_child(tmp_path, "busy", "forkserver", shm_dir)
    try:
        reaper_pid, *workers = _ready(proc)
        wait_until(lambda: len(_marked(marks, "busy")) == 2, 30, "both workers to be busy in fn")
        _kill_and_check(proc, lambda: os.listdir(shm_dir), [reaper_pid, *workers])
    finally:
        proc.kill()
        proc.communicate()


def test_sigkill_while_workers_start_leaves_nothing(tmp_path, shm_dir):
    # (c) both workers are still starting (unpickling the dataset)
    proc, marks = _start_child(tmp_path, "starting", "forkserver", shm_dir)
    try:
        reaper_pid, = _ready(proc)
        wait_until(lambda: len(_marked(marks, "starting")) == 2, 60, "both workers to be starting")
        _kill_and_check(proc, lambda: os.listdir(shm_dir), [reaper_pid, *_marked(marks, "starting")])
    finally:
        proc.kill()
        proc.communicate()


def test_sigkill_while_the_workers_are_stopped_leaves_nothing_in_shm_dir(tmp_path, shm_dir):
    # (d) every worker is stopped (SIGSTOP): none can notice the death, nor remove a file (their death
    # signal, SIGKILL, ends them where they stand): the reaper removes the files
    proc, _ = _start_child(tmp_path, "stopped", "fork", shm_dir)
    workers = []
    try:
        reaper_pid, *workers = _ready(proc)
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: _stopped(workers), 10, "the workers to be stopped")
        _kill_and_check(proc, lambda: os.listdir(shm_dir), [reaper_pid, *workers])
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_gone(workers, 10)
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("state", ["busy", "stopped"])
def test_anonymous_shared_memory_leaves_no_file_and_needs_no_reaper(tmp_path, state):
    # The default: nothing named anywhere, so no reaper runs; a SIGKILL leaves nothing in /dev/shm
    # (nothing was ever there), and the workers, who saw their parent die, leave with the memory.
    proc, marks = _start_child(tmp_path, state, "fork", "-")
    workers = []
    try:
        reaper_pid, *workers = _ready(proc)
        assert reaper_pid is None, "a loader of anonymous memory started a reaper"
        mine = f"procpipe-{proc.pid}-"
        in_dev_shm = lambda: [f for f in os.listdir("/dev/shm") if f.startswith(mine)]  # noqa: E731
        assert in_dev_shm() == []
        assert any(name.startswith(mine) for name in segments(proc.pid)), "no anonymous segment while it runs"
        if state == "busy":
            wait_until(lambda: len(_marked(marks, "busy")) == 2, 30, "both workers to be busy in fn")
        else:
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
            wait_until(lambda: _stopped(workers), 10, "the workers to be stopped")
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        # (a stopped worker too: its death signal, SIGKILL, ends it where it stands, and the memory with it)
        assert wait_gone(workers, GONE_WITHIN_S) == [], "a worker outlived the killed training process"
        assert in_dev_shm() == []
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_gone(workers, 10)
        proc.kill()
        proc.communicate()


# ------------------------------------------------------------------ the reaper itself
REGISTERS = r'''
import sys
from procpipe._core import reaper
for path in sys.argv[1:]:
    reaper.register(path)
print(reaper.reaper_pid(), flush=True)
sys.stdin.read()
'''


def test_the_reaper_removes_only_registered_regular_files_of_this_user(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    ours, link, unregistered = d / "procpipe-1-00000000-ring0", d / "procpipe-1-00000000-spec", d / "unregistered"
    ours.write_bytes(b"x" * 4096)
    os.symlink(precious, link)
    unregistered.write_text("not registered")
    registered = [ours, link, d / "never-created"]
    if os.geteuid() == 0:
        theirs = d / "procpipe-1-00000000-status"
        theirs.write_text("another user's")
        os.chown(theirs, 65534, 65534)
        registered.append(theirs)
    proc = subprocess.Popen([sys.executable, "-c", REGISTERS, *map(str, registered)], env=python_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        reaper_pid = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_gone([reaper_pid], 10) == [], "the reaper did not end after its process"
    finally:
        proc.kill()
        proc.communicate()
    assert not ours.exists()
    assert os.path.islink(link) and precious.read_text() == "keep me"
    assert unregistered.read_text() == "not registered"
    if os.geteuid() == 0:
        assert (d / "procpipe-1-00000000-status").read_text() == "another user's"


def test_a_killed_reaper_is_replaced_and_told_every_file(tmp_path):
    path = str(tmp_path / "procpipe-1-00000000-ring0")
    reaper.register(path)
    try:
        first = reaper.reaper_pid()
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: psutil.Process(first).status() == psutil.STATUS_ZOMBIE, 10, "the reaper to die")
        reaper.register(path + "x")  # finds it dead: a new one
        second = reaper.reaper_pid()
        assert second != first and psutil.Process(second).is_running()
        assert wait_gone([first], 1) == []  # collected, not a zombie child of ours
    finally:
        reaper.forget(path)
        reaper.forget(path + "x")


# ------------------------------------------------------------------ the start-up sweep
def _leftover(directory, pid, kind, nbytes=4096, age=SETTLE_S + 5.0, token="0badf00d"):
    path = os.path.join(directory, f"procpipe-{pid}-{token}-{kind}")
    with open(path, "wb") as f:
        f.write(b"\0" * nbytes)
    os.chmod(path, 0o600)
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_sweep_removes_a_dead_processs_files_and_nothing_else(tmp_path):
    d = str(tmp_path)
    dead = _dead_pid()
    removed = [_leftover(d, dead, "ring0", 1 << 20), _leftover(d, dead, "status"), _leftover(d, dead, "spec")]
    live = _leftover(d, 1, "ring0")  # pid 1 runs, and started long before the file was made
    young = _leftover(d, dead, "ring1", age=0.0)  # just made: its creator may lock it a moment later
    locked = _leftover(d, dead, "cache")  # its creator holds the lock: alive in another pid namespace
    strangers = [_leftover(d, dead, "notes"), _leftover(d, dead, "ring0", token="xyz")]
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    link = os.path.join(d, f"procpipe-{dead}-0badf00d-preload")
    os.symlink(precious, link)
    os.mkdir(os.path.join(d, f"procpipe-{dead}-0badf00d-records"))
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    lock = os.open(locked, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_SH)
        started = psutil.Process(sleeper.pid).create_time()
        reused = _leftover(d, sleeper.pid, "ring0", age=time.time() - started + 60)  # its pid was reused since
        swept = sweep(d)
    finally:
        os.close(lock)
        sleeper.kill()
        sleeper.wait()
    assert sorted(swept.paths) == sorted(removed + [reused])
    assert swept.pids == {dead, sleeper.pid}
    assert swept.nbytes >= (1 << 20) + 3 * 4096
    for path in [live, young, locked, *strangers, link]:
        assert os.path.lexists(path), path
    assert precious.read_text() == "keep me"
    assert os.path.isdir(os.path.join(d, f"procpipe-{dead}-0badf00d-records"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user (chown)")
def test_the_sweep_never_removes_another_users_file(tmp_path):
    theirs = _leftover(str(tmp_path), _dead_pid(), "ring0")
    os.chown(theirs, 65534, 65534)  # nobody's; root may unlink anything here, so the check is procpipe's
    assert sweep(str(tmp_path)).paths == []
    assert os.path.exists(theirs)


def test_a_loader_sweeps_its_shm_dir_once_and_says_what_it_removed(shm_dir, caplog):
    dead = _dead_pid()
    _leftover(shm_dir, dead, "ring0", 3 << 20)
    _leftover(shm_dir, dead, "status")
    with caplog.at_level(logging.WARNING, logger="procpipe"), \
            procpipe.Loader(range(8), batch_size=4, workers=1, shm_dir=shm_dir) as loader:
        assert [len(b) for b in loader] == [4, 4]
    messages = [r.getMessage() for r in caplog.records if "procpipe removed" in r.getMessage()]
    expected = (f"procpipe removed 2 file(s) (3.0 MiB) from {shm_dir} left by process(es) {dead} that "
                "ended without cleaning up (killed, or an older procpipe)")
    assert messages == [expected], messages
    assert os.listdir(shm_dir) == []
    _leftover(shm_dir, dead, "ring0")  # a second loader of this process does not sweep again
    with procpipe.Loader(range(8), batch_size=4, workers=1, shm_dir=shm_dir) as loader:
        assert sum(len(b) for b in loader) == 8
    assert len(os.listdir(shm_dir)) == 1
    os.unlink(os.path.join(shm_dir, os.listdir(shm_dir)[0]))


# ------------------------------------------------------------ the torch facade's snapshots
FACADE_CHILD = r'''
import sys
import numpy as np
import torch
import procpipe.torch
from procpipe._core import reaper

class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(np.full(4, i) for i in range(10**6))

loader = procpipe.torch.DataLoader(Stream(), batch_size=4, num_workers=2, shm_dir=sys.argv[1], slot_bytes=4096)
it = iter(loader)
next(it)
print("ready", reaper.reaper_pid(), flush=True)
sys.stdin.read()  # until killed
'''


def test_sigkill_of_a_facade_over_an_iterable_dataset_leaves_nothing(tmp_path, shm_dir):
    """Its replicas' snapshots are anonymous memory (procpipe.torch.snapshots): no name anywhere;
    the ring's files in shm_dir go (the reaper)."""
    pytest.importorskip("torch", reason="procpipe.torch needs torch (pip install procpipe[torch])")
    script = tmp_path / "facade.py"
    script.write_text(FACADE_CHILD)
    proc = subprocess.Popen([sys.executable, str(script), shm_dir], env=python_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        reaper_pid, = _ready(proc)
        assert [n for n in os.listdir(shm_dir) if "replica" in n] == []
        assert any(n.startswith(f"procpipe-{proc.pid}-") and "replica" in n for n in segments(proc.pid))
        _kill_and_check(proc, lambda: os.listdir(shm_dir), [reaper_pid])
    finally:
        proc.kill()
        proc.communicate()


# --------------------------------------------------------------------------- no cycle keeps a loader
def _zeros(i: int) -> np.ndarray:
    return np.zeros(256, np.float32) + i


def _records(shard: list) -> list:
    return shard


@pytest.mark.parametrize("streaming", [False, True], ids=["indexed", "shards"])
def test_abandoned_loader_frees_its_files_without_the_garbage_collector(streaming: bool) -> None:
    import gc
    import weakref

    from conftest import our_segments

    before = our_segments()
    source = procpipe.Shards([list(range(64)), list(range(64))], _records) if streaming else list(range(128))
    gc.collect()
    gc.disable()  # a re-run notebook cell: the loader is dropped mid-epoch, and no collection runs
    try:
        loader = procpipe.Loader(source, fn=_zeros, batch_size=4, workers=2)
        for k, _batch in enumerate(loader):
            if k == 2:
                break
        del _batch  # the last batch holds a ring slot: the loader is dropped with none in hand
        assert our_segments() - before, "the loader made no shared memory: the test proves nothing"
        gone = weakref.ref(loader)
        del loader
        assert gone() is None, "a reference cycle keeps the abandoned loader alive"
        assert our_segments() - before == set()  # no descriptor and no mapping of its memory left
    finally:
        gc.enable()


# --------------------------------------------------------------------------- descriptors of killed workers
class _HangsOnce:
    """Indices in ``hang`` hang on their first attempt (a marker file, shared by the workers,
    says it was made): the worker is killed after ``task_timeout``, and the retry returns."""

    def __init__(self, directory: str, hang: set[int], n: int, pace_s: float) -> None:
        self.directory, self.hang, self.n, self.pace_s = directory, hang, n, pace_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.float32:
        if i in self.hang:
            try:
                fd = os.open(os.path.join(self.directory, f"hung-{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass  # the retry
            else:
                os.close(fd)
                time.sleep(120)  # stuck: only the kill ends it
        time.sleep(self.pace_s)  # (the epoch outlasts task_timeout after the last hang: its kill counts)
        return np.float32(i)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("speculate", [None, 2.0], ids=["task_timeout", "speculate_lost"])
def test_killed_workers_descriptors_are_closed_without_the_garbage_collector(tmp_path, speculate) -> None:
    warm = procpipe.Loader(list(range(8)), batch_size=2, workers=2)  # (lazily made process-wide parts)
    list(warm)
    warm.close()
    del warm
    gc.collect()
    gc.disable()  # a job that freezes or disables the GC: nothing may wait for a collection
    try:
        before = _open_descriptors()
        hang, n = {6, 12, 18}, 64
        loader = procpipe.Loader(
            _HangsOnce(str(tmp_path), hang, n, pace_s=0.02), batch_size=1, workers=2, shuffle=False,
            task_timeout=0.5, speculate=speculate,
        )
        got = [int(x) for b in loader for x in b.tolist()]
        killed = loader.stats()["worker_deaths"]  # (each one killed: no sample fails)
        loader.close()
        del loader
        after = _open_descriptors()
        links = [o for o in gc.get_objects() if isinstance(o, LocalWorker)]  # (uncollected garbage included)
    finally:
        gc.enable()
    assert got == list(range(n))
    assert killed == len(hang), "the workers were not killed: the test proves nothing"
    assert after == before, f"{after - before} descriptors left open after {killed} workers were killed and close()"
    assert links == [], f"{len(links)} worker links kept by a reference cycle after close()"


# --------------------------------------------------------------------------- a stopped worker, a killed trainer
_TRAINER = r'''
import json, sys, threading
import numpy as np
import procpipe
from procpipe._worker import zygote

how = sys.argv[1]
if how == "zygote":  # a thread runs before the loader: its workers are forked from the zygote
    threading.Thread(target=threading.Event().wait, daemon=True).start()
loader = procpipe.Loader(list(range(10**6)), fn=np.float32, batch_size=4, workers=2,
                         **({"start_method": "forkserver"} if how == "forkserver" else {}))
it = iter(loader)
next(it)
print(json.dumps({"workers": loader.worker_pids, "zygote": zygote.pid()}), flush=True)
sys.stdin.read()  # until killed
'''


@pytest.mark.parametrize("how", ["fork", "zygote", "forkserver"])
def test_nothing_outlives_a_killed_training_process_whose_worker_is_stopped(tmp_path, how) -> None:
    import json
    import signal
    import subprocess
    import sys

    import psutil
    from conftest import python_env, wait_gone, wait_until

    script = tmp_path / "train.py"
    script.write_text(_TRAINER)
    proc = subprocess.Popen([sys.executable, str(script), how], env=python_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started: list[int] = []
    try:
        line = proc.stdout.readline()
        assert line, f"the training process did not start: {proc.stderr.read()}"
        info = json.loads(line)
        workers, zygote_pid = info["workers"], info["zygote"]
        started = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]  # zygote, workers, helpers
        assert zygote_pid in started and set(workers) <= set(started)
        parent = {"fork": proc.pid, "zygote": zygote_pid}.get(how)
        if parent is not None:  # (the case it claims: who forked the workers)
            assert {psutil.Process(w).ppid() for w in workers} == {parent}
        stopped = psutil.Process(workers[0])
        stopped.suspend()  # SIGSTOP: a debugger, a scheduler's suspend
        wait_until(lambda: stopped.status() == psutil.STATUS_STOPPED, 10, "the worker to be stopped")
        proc.kill()
        assert proc.wait(10) == -signal.SIGKILL
        survivors = wait_gone(started, 5.0)  # "a few seconds"
        described = [f"{p} {psutil.Process(p).name()} {psutil.Process(p).status()}" for p in survivors]
        assert survivors == [], f"outlived the training process by 5 s: {described}"
    finally:
        for pid in started:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        wait_gone(started, 10)
        proc.kill()
        proc.communicate()
