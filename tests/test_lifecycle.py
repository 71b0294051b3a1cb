"""Lifecycle: batches kept past close, consumer errors, Ctrl-C, GC, a killed parent.

Clean epochs, ``close`` (twice), the context manager, early exit and a new ``iter()``
mid-epoch are in test_start_methods.py, run under every start method.

Every test checks the process table (psutil) and the shared-memory files, not only that
calls return; waits are polls with a deadline, never bare sleeps.
"""
from __future__ import annotations

import gc
import os
import selectors
import signal
import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest
from conftest import (
    CTRL_C_READY,
    START_METHODS,
    assert_cleaned,
    assert_running,
    descendants,
    interrupt,
    python_env,
    run_python,
    segments,
    shm_files,
    signal_state,
    wait_gone,
    wait_until,
)

from procpipe import Loader

N, BS = 48, 4
EXPECTED = [list(range(k, k + BS)) for k in range(0, N, BS)]


def square(i):
    return {"x": np.full(16, i, np.int64), "y": i * i}


def firsts(batches):
    return [b["x"][:, 0].tolist() for b in batches]


def test_batches_stay_valid_after_close():
    with Loader(list(range(N)), square, batch_size=BS, workers=2, slot_bytes=1 << 14) as loader:
        it = iter(loader)
        kept = [next(it) for _ in range(3)]
        pids, prefix = assert_running(loader)
    assert_cleaned(pids, prefix)
    assert firsts(kept) == EXPECTED[:3]
    assert kept[2]["y"].tolist() == [64, 81, 100, 121]


def test_workers_persist_across_epochs():
    with Loader(list(range(N)), square, batch_size=BS, workers=2, shuffle=True) as loader:
        pids = loader.worker_pids
        started = [psutil.Process(p).create_time() for p in pids]
        for _ in range(3):
            assert sorted(i for b in firsts(loader) for i in b) == list(range(N))
            assert loader.worker_pids == pids
            assert [psutil.Process(p).create_time() for p in pids] == started
        assert set(pids) <= descendants()


class ConsumerBug(Exception):
    pass


def test_exception_in_the_loop_body():
    # caught by the caller: the loader stays usable
    with Loader(list(range(N)), square, batch_size=BS, workers=2) as loader:
        pids, prefix = assert_running(loader)
        with pytest.raises(ConsumerBug):
            for n, _batch in enumerate(loader):
                if n == 2:
                    raise ConsumerBug
        assert firsts(loader) == EXPECTED
        assert loader.worker_pids == pids
    assert_cleaned(pids, prefix)
    # propagating out of the with block: everything is cleaned up
    with pytest.raises(ConsumerBug):
        with Loader(list(range(N)), square, batch_size=BS, workers=2) as loader:
            pids, prefix = assert_running(loader)
            for n, _batch in enumerate(loader):
                if n == 1:
                    raise ConsumerBug
    assert_cleaned(pids, prefix)


@pytest.mark.parametrize("iterate", [False, True])
def test_garbage_collection_of_an_unclosed_loader(iterate):
    loader = Loader(list(range(N)), square, batch_size=BS, workers=2)
    pids, prefix = assert_running(loader)
    it = batch = None
    if iterate:  # an epoch in progress: the loader and its iterator reference each other
        it = iter(loader)
        batch = next(it)
    del loader, it
    gc.collect()
    assert_cleaned(pids, prefix)
    if iterate:
        assert firsts([batch]) == [EXPECTED[0]]  # a batch kept past the loader's life stays valid


# --------------------------------------------------------------------------- other processes
SCRIPT = textwrap.dedent('''
    import sys
    import time

    import numpy as np
    import procpipe


    def slow(i):
        time.sleep(0.05)
        return np.full(4, i)


    if __name__ == "__main__":
        mode = sys.argv[1]
        shm_dir = sys.argv[3] if len(sys.argv) > 3 else None
        loader = procpipe.Loader(list(range(100_000)), slow, batch_size=2, workers=2,
                                 start_method=sys.argv[2], shm_dir=shm_dir)
        print(loader.shm_prefix, *loader.worker_pids, flush=True)
        if mode == "exit":
            print(sum(int(b.sum()) for b, _ in zip(loader, range(3))), flush=True)
            sys.exit(0)  # no close(): interpreter exit must clean up
        if mode == "with":
            with loader:
                for i, b in enumerate(loader):
                    if i == 2:
                        print("looping", flush=True)
        else:
            for i, b in enumerate(loader):
                if i == 2:
                    print("looping", flush=True)
''')


class Child:
    """A Python subprocess running SCRIPT; reads its lines with a deadline."""

    def __init__(self, tmp_path, *args, session=False):
        script = tmp_path / "consumer.py"
        script.write_text(CTRL_C_READY + SCRIPT)  # (a test's Ctrl-C reaches it however pytest was started)
        self.proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=python_env(), cwd=str(tmp_path),
                                     start_new_session=session)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def line(self, timeout=60.0):
        if not self._sel.select(timeout):
            self.kill()
            pytest.fail(f"no output from the child in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            pytest.fail(f"child exited with {self.proc.returncode}: {self.proc.stderr.read()}")
        return line.split()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self):
        self.kill()
        self._sel.close()
        self.proc.stdout.close()
        self.proc.stderr.close()


def _start(tmp_path, mode, start_method="forkserver", session=False, shm_dir=None):
    child = Child(tmp_path, mode, start_method, *([shm_dir] if shm_dir else []), session=session)
    prefix, *pids = child.line()
    pids = [int(p) for p in pids]
    assert len(pids) == 2 and set(pids) <= descendants(child.proc.pid)
    return child, (None if prefix == "None" else prefix), pids


def _shared_memory(child, prefix):
    """The child loader's files (``prefix``: in an shm_dir), or the anonymous segments it holds."""
    if prefix is not None:
        return shm_files(prefix)
    return sorted(n for n in segments(child.proc.pid) if n.startswith(f"procpipe-{child.proc.pid}-"))


def _cleaned(tree, prefix, timeout=15.0):
    """No process of ``tree`` runs, and no file of ``prefix`` is left (anonymous memory: nothing to
    leave, it went with its last process)."""
    survivors = wait_gone(tree, timeout)
    assert survivors == [], f"processes {survivors} outlived their parent's cleanup"
    if prefix is not None:
        wait_until(lambda: not shm_files(prefix), timeout, f"removal of {prefix}*")


@pytest.mark.parametrize("mode,terminal", [("with", False), ("bare", False), ("bare", True)],
                         ids=["with", "bare", "bare-terminal"])
def test_keyboard_interrupt_cleans_up(tmp_path, mode, terminal, shm_dir):
    # terminal: Ctrl-C as a terminal sends it, to the whole process group (the workers, the zygote,
    # the forkserver and the resource tracker are in it; the reaper has a session of its own)
    child, prefix, pids = _start(tmp_path, mode, session=terminal, shm_dir=None if terminal else shm_dir)
    try:
        assert child.line() == ["looping"]
        tree = descendants(child.proc.pid)  # workers, forkserver, resource tracker
        assert set(pids) <= tree and _shared_memory(child, prefix)
        _, stderr = interrupt(child.proc, 30, group=terminal)  # (a child that does not exit fails with its stacks)
        assert child.proc.returncode != 0 and "KeyboardInterrupt" in stderr, stderr
        assert stderr.count("Traceback") == 1, stderr  # the loop's: nothing from the other processes
        _cleaned(tree, prefix)
    finally:
        child.close()


def test_workers_take_their_signals_whatever_mask_the_training_process_has():
    # A signal mask is inherited by fork and exec: a training process started with SIGTERM and
    # SIGUSR1 blocked (by its launcher) gave them to its workers, which then ignored a closing
    # loader's ABANDON_SIGNAL (SIGUSR1) and their parent's death signal (SIGTERM).
    blocked = {signal.SIGTERM, signal.SIGUSR1}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        with Loader(list(range(N)), square, batch_size=BS, workers=2, start_method="fork") as loader:
            assert signal_state(os.getpid(), signal.SIGUSR1) == "blocked"  # (the test's premise)

            def states() -> dict[int, list[str]]:
                return {pid: [signal_state(pid, s) for s in sorted(blocked)] for pid in loader.worker_pids}

            # "caught": the worker's handlers are in place and not blocked ("blocked" else)
            wait_until(lambda: all(s == ["caught", "caught"] for s in states().values()), 15,
                       "workers taking SIGTERM and SIGUSR1")
            assert firsts(loader) == EXPECTED
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def test_a_training_process_that_ignores_sigint_keeps_it_ignored(tmp_path):
    # Started with SIGINT ignored (nohup, a background job of a script): a Ctrl-C is not meant for
    # it, and procpipe does not change that, closing a loader included (api/shutdown.py).
    script = tmp_path / "ignoring.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        import procpipe
        with procpipe.Loader(list(range(8)), lambda i: i, batch_size=2, workers=2) as loader:
            assert sum(len(b) for b in loader) == 8
        os.kill(os.getpid(), signal.SIGINT)  # ignored: the script goes on
        print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
    """))
    done = run_python([str(script)], timeout=120)
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr


def test_interpreter_exit_without_close_cleans_up(tmp_path, shm_dir):
    child, prefix, pids = _start(tmp_path, "exit", shm_dir=shm_dir)
    try:
        assert child.line() == [str(sum(4 * i for i in range(6)))]
        tree = descendants(child.proc.pid) | set(pids)
        assert child.proc.wait(30) == 0
        _cleaned(tree, prefix)
    finally:
        child.close()


@pytest.mark.parametrize("shm", ["anonymous", "shm_dir"])
@pytest.mark.parametrize("start_method", START_METHODS)
def test_sigkilled_parent_leaves_no_workers_and_no_files(tmp_path, start_method, shm, shm_dir):
    child, prefix, pids = _start(tmp_path, "bare", start_method, shm_dir=shm_dir if shm == "shm_dir" else None)
    try:
        assert child.line() == ["looping"]
        tree = descendants(child.proc.pid) | set(pids)
        assert _shared_memory(child, prefix)
        os.kill(child.proc.pid, signal.SIGKILL)
        assert child.proc.wait(10) == -signal.SIGKILL
        survivors = wait_gone(tree, 15)
        assert survivors == [], f"processes {survivors} outlived their SIGKILLed parent"
        _cleaned(tree, prefix)
    finally:
        child.close()


def test_starting_forked_workers_leaves_the_users_gc_freeze_alone():
    # gc.get_objects() lists the collector's generations, not the permanent one that
    # gc.freeze() moves objects to; counting is no good (a frozen object that dies leaves it).
    marker = [object()]  # a container the collector tracks
    gc.freeze()  # the user's own (e.g. a server that froze its preloaded state)
    try:
        assert not any(o is marker for o in gc.get_objects())
        with Loader(range(16), square, batch_size=4, workers=2, start_method="fork") as loader:
            assert sum(len(b["y"]) for b in loader) == 16
        # before the fix gc.unfreeze() after each start moved everything back
        assert not any(o is marker for o in gc.get_objects())
    finally:
        gc.unfreeze()


class Images:
    """Image-sized samples: a batch of 32 is 1.5 MiB, far more than a pipe holds."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        return np.full((3, 64, 64), i, np.float32), np.int64(i % 10)


def test_dropping_an_iterator_after_the_first_batch_does_not_kill_workers(monkeypatch):
    """Workers blocked sending large inline batches must see the stop (their replies are
    drained while they stop), not wait to be killed after the 2 s grace period."""
    torch_data = pytest.importorskip("procpipe.torch")
    import procpipe._engine.pool

    killed: list[int] = []
    kill_tree = procpipe._engine.pool.kill_tree
    monkeypatch.setattr(procpipe._engine.pool, "kill_tree", lambda pid, wait=True: (killed.append(pid), kill_tree(pid, wait)))
    # fork: workers that start in milliseconds, so the grace period measures the stop, not a slow start
    loader = torch_data.DataLoader(Images(), batch_size=32, num_workers=2, multiprocessing_context="fork")
    first = next(iter(loader))  # the iterator is dropped at once: its loader closes
    assert first[0].shape == (32, 3, 64, 64)
    assert killed == [], "workers had to be killed: they never saw the stop"


# --------------------------------------------------------------------------- Ctrl-C twice
CTRL_C_SCRIPT = r"""
import os, signal, sys, time
import numpy as np
import procpipe
from procpipe._engine.coordinator import Coordinator

close = Coordinator.close


def note(what):
    with open(sys.argv[1], "a") as f:
        f.write(what + "\n")


def close_with_a_second_ctrl_c(self, *args, **kwargs):
    note("closing")
    if sys.argv[2] == "twice":
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C again while the loader closes at exit
    close(self, *args, **kwargs)


Coordinator.close = close_with_a_second_ctrl_c


def slow(i):
    note("sample")
    time.sleep(0.05)
    return np.zeros(256, np.float32) + i


loader = procpipe.Loader(list(range(100_000)), fn=slow, batch_size=4, workers=2)
for k, batch in enumerate(loader):
    if k == 2:
        print("looping", flush=True)
"""


@pytest.mark.parametrize("presses", ["once", "twice"])
def test_ctrl_c_exits_without_noise_or_waiting_for_queued_batches(tmp_path, presses: str) -> None:
    import subprocess
    import sys

    from conftest import CTRL_C_READY, interrupt, python_env, shm_files

    script = tmp_path / "train.py"
    script.write_text(CTRL_C_READY + CTRL_C_SCRIPT)  # (Ctrl-C reaches it however pytest was started)
    notes = tmp_path / "notes"
    child = subprocess.Popen([sys.executable, str(script), str(notes), presses], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=python_env())
    try:
        assert child.stdout.readline() == "looping\n"
        _, stderr = interrupt(child, 60)  # (a child that does not exit fails with its stacks)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert stderr.rstrip().endswith("KeyboardInterrupt"), stderr
    assert "Exception ignored" not in stderr and "lost sys.stderr" not in stderr, stderr
    assert stderr.count("KeyboardInterrupt") == 1, stderr  # one traceback: the loop's
    assert shm_files(f"/dev/shm/procpipe-{child.pid}-") == []
    # Exiting does not wait for the batches queued in the workers' pipes (before: every task queued,
    # tens of samples): at most two per worker, the one under way as the close began and one it may
    # start before the close's ABANDON_SIGNAL reaches it (a 50 ms sample: under load, that happened
    # once in 50 runs with a bound of one per worker).
    lines = notes.read_text().splitlines()
    assert lines.count("closing") == 1 and lines[lines.index("closing") + 1:].count("sample") <= 4, lines


CTRL_C_IN_A_FINALIZER_SCRIPT = r"""
import signal, sys
import numpy as np
import procpipe
from procpipe._core import rings
from procpipe._consumer.prefetch import Prefetcher

release, armed = rings.RingSet.release, []


def release_then_ctrl_c(self, slot):
    release(self, slot)
    if armed:
        armed.clear()
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, its handler run while the lease ends


rings.RingSet.release = release_then_ctrl_c
with procpipe.Loader(np.arange(64), batch_size=4, workers=1) as loader:
    it = iter(loader)
    if sys.argv[1] == "prefetched":  # a device stage's thread takes the batches (a JAX or CUDA transfer's place)
        it = Prefetcher(it, lambda b: (b, None), depth=2)
    taken = [next(it).tolist()]  # (the first batch may come before the ring is made)
    batch = next(it)
    assert rings.ring_of(batch) is not None  # a view of a ring slot: its lease's __del__ returns it
    taken.append(batch.tolist())
    armed.append(True)
    del batch  # the lease's __del__: the KeyboardInterrupt is raised in it
    print("after the finalizer", flush=True)
    try:
        taken.append(next(it).tolist())
        print("not interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted at next()", flush=True)
    taken += [b.tolist() for b in it]  # (as after a Jupyter interrupt: the iteration goes on)
    print("every sample once:", sorted(x for b in taken for x in b) == list(range(64)), flush=True)
    getattr(it, "close", lambda: None)()
"""


@pytest.mark.parametrize("stage", ["plain", "prefetched"])
def test_a_ctrl_c_in_a_batchs_finalizer_is_raised_at_the_next_step_not_lost(tmp_path, stage: str) -> None:
    """Python cannot raise a KeyboardInterrupt out of a ``__del__`` (it prints "Exception ignored"
    and goes on): a Ctrl-C whose handler ran as a batch's last view died was lost, and the training
    loop ran on (seen once in CI: the Ctrl-C test's child did not exit). The lease defers it to the
    iterator's next step, before a batch is taken: nothing lost, the iteration can go on. Behind a
    device stage, in the main thread's ``next()`` (the stage's thread takes batches too)."""
    from conftest import CTRL_C_READY, run_python

    script = tmp_path / "finalizer.py"
    script.write_text(CTRL_C_READY + CTRL_C_IN_A_FINALIZER_SCRIPT)
    out = run_python([str(script), stage])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == ["after the finalizer", "interrupted at next()", "every sample once: True"], \
        out.stdout + out.stderr
    assert "Exception ignored" not in out.stderr and "KeyboardInterrupt" not in out.stderr, out.stderr


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_a_deferred_ctrl_c_is_raised_in_the_main_thread_only_and_once() -> None:
    """A device stage's thread also takes batches (and calls ``raise_deferred``): the interrupt
    must wait for the main thread, where Python raises a Ctrl-C's, and come once."""
    import threading

    from procpipe._core.deferred_interrupt import defer, raise_deferred

    raised: list[BaseException] = []

    def in_a_thread() -> None:
        try:
            raise_deferred()
        except BaseException as exc:  # noqa: BLE001 - what the thread saw is the result
            raised.append(exc)

    defer()
    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and raised == []
    with pytest.raises(KeyboardInterrupt):
        raise_deferred()
    raise_deferred()  # once: nothing is pending now


_EXITING_WORKERS_SCRIPT = r'''
import sys, threading
import numpy as np
import procpipe
if sys.argv[1] == "zygote":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
method = {"zygote": "auto", "auto": "auto"}.get(sys.argv[1], sys.argv[1])
with procpipe.Loader(list(range(16)), fn=np.float32, batch_size=4, workers=2, start_method=method) as loader:
    print(sum(len(b) for b in loader), flush=True)
'''


@pytest.mark.parametrize("how", ["auto", "zygote", "forkserver"])
def test_exiting_workers_leave_no_resource_warning(tmp_path, how: str) -> None:
    from conftest import run_python

    script = tmp_path / "exiting.py"
    script.write_text(_EXITING_WORKERS_SCRIPT)
    out = run_python(["-X", "dev", "-W", "default", str(script), how])  # warnings on, ResourceWarning too
    assert out.returncode == 0 and out.stdout.strip() == "16", out.stderr
    assert "ResourceWarning" not in out.stderr, out.stderr
