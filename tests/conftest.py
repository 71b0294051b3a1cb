"""Shared fixtures and helpers for procpipe's tests.

Every test is checked for leaks by the autouse fixture ``no_leaks``: after the test (and
a ``gc.collect()``, since garbage collection of a loader is a supported way to clean up),
it waits up to ``LEAK_DEADLINE_S`` for

- every child process the test started (psutil, recursive) to be gone,
- every ``procpipe-<this pid>-*`` file in ``/dev/shm`` the test created to be gone, and
- every segment of anonymous shared memory procpipe made in this process during the test
  (a memfd named ``procpipe-<this pid>-*``) to be released: no descriptor and no mapping of it left.

multiprocess's forkserver and resource-tracker processes and procpipe's reaper are process-wide singletons that
outlive a test by design; they are ignored, but the workers they fork are not. A leak fails
the test (as an error in teardown), then the leaked processes are killed and the files
removed so that one failure does not cascade into the next tests.
Opt out with ``@pytest.mark.allow_leaks`` (e.g. a test that deliberately orphans a worker).

The fast subset: a test (or a module, ``pytestmark = pytest.mark.unit``) marked ``unit`` starts no
process, so ``python -m pytest -m unit`` runs alone in under a minute. The autouse fixture
``unit_starts_no_process`` holds it to that: in a ``unit`` test, starting a process
(multiprocess's or multiprocessing's ``Process.start``, ``subprocess``, ``os.fork``) raises.

The autouse fixture ``hang_guard`` dumps every thread's stack and ends the run if a test
exceeds ``PROCPIPE_TEST_TIMEOUT_S`` seconds (default 180), so a deadlock fails loudly
instead of hanging CI; raise it for one test with ``@pytest.mark.timeout_s(600)``.

Helpers, importable from the tests (``from conftest import wait_until, ...``):

- ``wait_until(condition, timeout, what)``: poll a condition until it holds or fail;
  use it (or ``wait_gone``) instead of a ``time.sleep`` standing in for synchronization.
- ``wait_gone(pids, timeout)``: pids still running after the deadline (zombies count as gone).
- ``descendants(pid=None)``: pids of the live (non-zombie) descendants of a process.
- ``shm_files(prefix)`` / ``our_shm_files()``: existing files with a prefix / of this process;
  ``segments(pid)`` / ``our_segments()``: procpipe's anonymous shared memory a process holds (memfd
  names, by descriptor or mapping) / made by this process; ``loader_token(loader)``: the name every
  segment of a loader begins with.
- ``ring_views(batch)`` / ``is_ring_view(arr)``: whether arrays are zero-copy views of a ring slot;
  ``mappings(prefix)``: address ranges where files with that prefix are mapped in this process.
- ``leaves(batch)``: the leaves of a batch tree; ``to_py(batch)``: a batch as plain Python, for
  whole-structure comparisons.
- ``assert_running(loader)`` -> ``(pids, prefix)``, then ``assert_cleaned(pids, prefix)``: a loader's
  workers and shared memory (files, or anonymous segments) exist while it runs / are all gone after
  cleanup (with a deadline).
- ``run_python(args, ...)``: run a Python subprocess with procpipe importable, with a timeout;
  ``python_env()``: the environment for a ``subprocess.Popen`` of your own.
- ``CTRL_C_READY`` (the first lines of a child script that a test sends SIGINT) and
  ``interrupt(proc, timeout)``: send it SIGINT and wait for its exit; a child that does not exit
  fails the test with its stacks (faulthandler, py-spy if installed) and its signal state.

Fixture ``shm_dir``: a fresh directory for ``Loader(shm_dir=...)``, checked empty at the end.
"""
from __future__ import annotations

import faulthandler
import gc
import glob
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import psutil
import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # before any test module imports keras

SHM_DIR = "/dev/shm"
LEAK_DEADLINE_S = 15.0
START_METHODS = ("fork", "forkserver", "spawn")  # every start method a test suite runs under
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INFRASTRUCTURE = ("forkserver import main", "resource_tracker import main", "semaphore_tracker import main",
                   "procpipe-reaper")  # (procpipe._core.reaper: one per process, it outlives it by design)
_ZYGOTE = "procpipe-zygote"  # the process name of procpipe._worker.zygote (one per process, forked at import)


# --------------------------------------------------------------------------- polling
def wait_until(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition",
               interval: float = 0.02) -> Any:
    """Poll ``condition()`` until it returns something truthy (returned) or fail the test."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@contextmanager
def warnings_as_errors() -> Iterator[None]:
    """Every warning raised inside is an error, except ``SlowStartWarning``: whether
    ``start_method="auto"`` can fork depends on the threads of the test process (a pytest-xdist
    worker runs execnet's threads, which procpipe cannot tell from a library's), and the warning
    comes once per process, at whichever test starts workers first. The tests of that warning
    are in test_startup.py."""
    from procpipe._worker.start_method import SlowStartWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", SlowStartWarning)
        yield


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: Iterable[int], timeout: float = 10.0) -> list[int]:
    """Wait until no process in ``pids`` runs (zombies count as gone); returns the survivors."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        survivors = [p for p in pids if _alive(p)]
        if not survivors or time.monotonic() >= deadline:
            return survivors
        time.sleep(0.02)


# --------------------------------------------------------------------------- processes
def _is_infrastructure(proc: psutil.Process) -> bool:
    try:
        cmdline = " ".join(proc.cmdline())
        name = proc.name()
    except psutil.Error:
        return False
    return any(marker in cmdline for marker in _INFRASTRUCTURE) or name == _ZYGOTE


def descendants(pid: int | None = None, include_infrastructure: bool = True) -> set[int]:
    """Live descendants of ``pid`` (default: this process).

    With ``include_infrastructure=False``, this process's forkserver and resource tracker
    themselves are left out (not the workers the forkserver forks).
    """
    try:
        root = psutil.Process(pid)
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    out = set()
    for child in children:
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if not include_infrastructure and child.ppid() == root.pid and _is_infrastructure(child):
                continue
        except psutil.NoSuchProcess:
            continue
        out.add(child.pid)
    return out


def _describe(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return f"{pid} ({p.name()}, parent {p.ppid()}, {' '.join(p.cmdline())[:120]!r})"
    except psutil.Error:
        return str(pid)


def _kill(pids: Iterable[int]) -> None:
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.kill()
            procs.append(p)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


# --------------------------------------------------------------------------- shared memory
def shm_files(prefix: str) -> list[str]:
    """Files whose path starts with ``prefix`` (e.g. ``loader.shm_prefix``)."""
    return sorted(glob.glob(glob.escape(prefix) + "*"))


def our_shm_files(directory: str = SHM_DIR, pid: int | None = None) -> set[str]:
    """procpipe files created by process ``pid`` (default: this one) in ``directory``."""
    return set(shm_files(os.path.join(directory, f"procpipe-{pid or os.getpid()}-")))


_MEMFD = "/memfd:"


def segments(pid: int | None = None) -> set[str]:
    """Names of the procpipe memfds process ``pid`` (default: this one) holds, by descriptor or
    mapping (``procpipe-<creator pid>-<token>-<what>``, from /proc/<pid>/fd and /proc/<pid>/maps)."""
    where = f"/proc/{pid or 'self'}"
    found = set()
    try:
        for fd in os.listdir(f"{where}/fd"):
            try:
                target = os.readlink(f"{where}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(_MEMFD + "procpipe-"):
                found.add(target[len(_MEMFD):].removesuffix(" (deleted)"))
        with open(f"{where}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(_MEMFD + "procpipe-"):
                    found.add(parts[5].strip()[len(_MEMFD):].removesuffix(" (deleted)"))
    except OSError:
        pass
    return found


def segment_fds(prefix: str) -> list[int]:
    """This process's descriptors of procpipe's anonymous segments whose name begins with ``prefix``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(_MEMFD + prefix):
            found.append(int(fd))
    return found


def our_segments() -> set[str]:
    """procpipe's anonymous shared memory made by this process that this process still holds."""
    mine = f"procpipe-{os.getpid()}-"
    return {name for name in segments() if name.startswith(mine)}


def loader_token(loader: Any) -> str:
    """The name every shared-memory segment of ``loader`` begins with (``procpipe-<pid>-<token>-``)."""
    return loader._coordinator.segments.token


def _ring_lease(arr: np.ndarray) -> Any:
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base


def is_ring_view(arr: Any) -> bool:
    """True if ``arr`` is a numpy array whose memory is a procpipe ring slot (not a copy)."""
    return (isinstance(arr, np.ndarray) and not arr.flags.owndata
            and type(_ring_lease(arr)).__name__ == "SlotLease")


def leaves(tree: Any) -> list[Any]:
    """The leaves of a batch (dicts, lists and tuples are walked; arrays are leaves)."""
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in leaves(v)]
    return [tree]


def to_py(tree: Any) -> Any:
    """A batch as plain Python (arrays become (dtype, nested lists)) for whole-structure comparisons."""
    if isinstance(tree, dict):
        return {k: to_py(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree).__name__, [to_py(v) for v in tree]
    if isinstance(tree, np.ndarray):
        return str(tree.dtype), tree.tolist()
    return tree


def ring_views(batch: Any) -> list[bool]:
    """For every array leaf of ``batch``: whether it is a ring view."""
    return [is_ring_view(a) for a in leaves(batch) if isinstance(a, np.ndarray)]


def mappings(prefix: str) -> list[tuple[int, int]]:
    """Address ranges of this process's memory mappings of files whose path starts with ``prefix``
    (e.g. ``loader.shm_prefix``), or of procpipe's anonymous segments whose name does (a prefix
    without a ``/``: ``loader_token(loader)``), from /proc/self/maps."""
    if os.sep not in prefix:
        prefix = _MEMFD + prefix
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().startswith(prefix):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((start, end))
    return ranges


# --------------------------------------------------------------------------- a loader's processes and files
def _held(prefix: str, batches_may_hold_the_ring: bool = False) -> list[str]:
    """The files with ``prefix`` (a path), or the segments this process holds whose name begins with
    it (``batches_may_hold_the_ring``: but the ring's, which batches the test keeps still map)."""
    if os.sep in prefix:
        return shm_files(prefix)
    return sorted(name for name in segments() if name.startswith(prefix)
                  and not (batches_may_hold_the_ring and name[len(prefix):].startswith("ring")))


def left_of(prefix: str) -> list[str]:
    """What is left of a loader's shared memory (``prefix``: from ``assert_running``): its files, or
    the segments this process holds but a ring that batches the test keeps still map."""
    return _held(prefix, batches_may_hold_the_ring=True)


def assert_running(loader: Any) -> tuple[list[int], str]:
    """Check that ``loader`` runs its workers (live descendants of this process) and has its
    shared memory (its files in ``shm_dir``, or anonymous segments); returns ``(worker pids, the
    prefix of its files or its segments' names)`` for ``assert_cleaned``."""
    pids = loader.worker_pids
    assert len(pids) == loader.workers_setting and len(set(pids)) == len(pids)
    assert set(pids) <= descendants(), "workers are not live descendants of this process"
    prefix = loader.shm_prefix if loader.shm_prefix is not None else loader_token(loader)
    assert _held(prefix), "no shared memory while the loader runs"
    return pids, prefix


def assert_cleaned(pids: Iterable[int], prefix: str, timeout: float = 15.0) -> None:
    """Wait until none of ``pids`` runs and nothing of ``prefix`` is left (a file with it, or a
    segment whose name begins with it, held by this process: but a ring that batches the test
    keeps still map, whose memory goes with them), or fail."""
    survivors = wait_gone(pids, timeout)
    assert survivors == [], f"workers {survivors} still running {timeout} s after cleanup"
    wait_until(lambda: not left_of(prefix), timeout, f"removal of {prefix}*")


# --------------------------------------------------------------------------- subprocesses
def python_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_python(args: list[str], timeout: float = 120, cwd: str | None = None,
               **kwargs: Any) -> subprocess.CompletedProcess:
    """``python <args>`` to completion (text output captured); fails the test on timeout."""
    try:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=cwd, env=python_env(), **kwargs)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"python {' '.join(args)} did not finish in {timeout} s; output:\n{exc.stdout}\n{exc.stderr}")


# --------------------------------------------------------------------------- Ctrl-C in a child
# The first lines of a child script that a test sends SIGINT. A process started with SIGINT
# ignored keeps it ignored (Python installs its KeyboardInterrupt handler only over SIG_DFL),
# and one started with SIGINT blocked keeps it blocked: both are inherited through fork and
# exec, and a CI job run in the background of a non-interactive shell (`cmd &`) starts with
# SIGINT ignored, so pytest, its xdist workers and every child would ignore the test's Ctrl-C.
# The child takes the interactive state, as a user's training process in a terminal has it,
# and dumps its stacks on SIGUSR2 (``interrupt``) if it does not exit.
CTRL_C_READY = (
    "import faulthandler, signal\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\n"
    "faulthandler.register(signal.SIGUSR2, all_threads=True)\n"
)


def signal_state(pid: int, signum: int) -> str:
    """How process ``pid`` takes ``signum``, from /proc: "blocked", "ignored", "caught" or "default"."""
    masks = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("SigBlk", "SigIgn", "SigCgt"):
                    masks[key] = int(value, 16)
    except OSError as exc:
        return f"unknown ({exc})"
    bit = 1 << (signum - 1)
    for key, state in (("SigBlk", "blocked"), ("SigIgn", "ignored"), ("SigCgt", "caught")):
        if masks.get(key, 0) & bit:
            return state
    return "default"


def interrupt(proc: subprocess.Popen, timeout: float, group: bool = False) -> tuple[Any, Any]:
    """Send SIGINT to ``proc`` (a script that starts with ``CTRL_C_READY``) and return its
    ``communicate()`` once it exits; ``group``: to its whole process group, as a terminal's Ctrl-C
    (``proc`` started with ``start_new_session=True``). If SIGINT cannot reach it, or it does not exit within
    ``timeout`` seconds, fail the test with what explains it: the SIGINT state of the child, its
    processes and this one, the child's stacks (SIGUSR2: faulthandler; py-spy too where
    installed), then its output. The child is killed."""
    __tracebackhide__ = True
    state = signal_state(proc.pid, signal.SIGINT)
    if state in ("blocked", "ignored"):
        problem = f"SIGINT is {state} in the child (pid {proc.pid}): a Ctrl-C cannot reach it"
    else:
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        try:
            return proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            problem = f"the child (pid {proc.pid}) did not exit within {timeout:.0f} s of SIGINT"
    report = [problem, f"SIGINT in this test process (pid {os.getpid()}): {signal_state(os.getpid(), signal.SIGINT)}"]
    report += [f"  {_describe(pid)}: SIGINT {signal_state(pid, signal.SIGINT)}"
               for pid in [proc.pid, *sorted(descendants(proc.pid))]]
    spy = shutil.which("py-spy")
    if spy:
        dump = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60,
                              check=False)
        report.append(f"py-spy dump:\n{dump.stdout}{dump.stderr}")
    proc.send_signal(signal.SIGUSR2)  # faulthandler writes every thread's stack to its stderr
    try:
        proc.communicate(timeout=3)  # (it does not exit: a bounded wait for the dump, which communicate keeps)
    except subprocess.TimeoutExpired:
        pass
    proc.kill()
    out, err = proc.communicate()
    pytest.fail("\n".join(report) + f"\nits stdout:\n{out}\nits stderr (its stacks last):\n{err}")


# --------------------------------------------------------------------------- fixtures
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "allow_leaks: skip the autouse check for leaked processes and /dev/shm files")
    config.addinivalue_line("markers", "timeout_s(seconds): per-test hang guard (default PROCPIPE_TEST_TIMEOUT_S or 180)")
    # pytest-xdist's own marker, declared here too for runs without it: under `-n 2 --dist loadgroup`
    # the tests of one group run in one worker (those that start a Ray cluster: one cluster at a time).
    config.addinivalue_line("markers", "xdist_group(name): run in the same pytest-xdist worker as the rest of the group")
    config.addinivalue_line("markers", "unit: starts no process: `python -m pytest -m unit` runs them in under a minute")


def _stderr_fd(config: pytest.Config) -> int:
    """The real stderr (pytest's faulthandler plugin keeps a copy; capture redirects fd 2)."""
    try:
        from _pytest.faulthandler import fault_handler_stderr_fd_key

        return config.stash[fault_handler_stderr_fd_key]
    except (ImportError, KeyError):
        return sys.__stderr__.fileno()


@pytest.fixture(autouse=True)
def hang_guard(request: pytest.FixtureRequest):
    marker = request.node.get_closest_marker("timeout_s")
    seconds = float(marker.args[0]) if marker else float(os.environ.get("PROCPIPE_TEST_TIMEOUT_S", "180"))
    faulthandler.dump_traceback_later(seconds, exit=True, file=_stderr_fd(request.config))
    yield
    faulthandler.cancel_dump_traceback_later()


class StartedAProcess(AssertionError):
    """A ``unit`` test started a process (``unit_starts_no_process``)."""


@pytest.fixture(autouse=True)
def unit_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """In a test marked ``unit``, every way procpipe or a test starts a process raises."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    import multiprocessing.process

    import multiprocess.process

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise StartedAProcess("a unit test started a process: take its unit mark off (tests/conftest.py)")

    monkeypatch.setattr(multiprocess.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    yield


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest):
    """Fail a test that leaves child processes or procpipe files of this process behind."""
    if request.node.get_closest_marker("allow_leaks"):
        yield
        return
    procs_before = descendants()
    files_before = our_shm_files()
    segments_before = our_segments()
    yield
    new_procs: set[int] = set()
    new_files: set[str] = set()
    new_segments: set[str] = set()

    def clean() -> bool:
        nonlocal new_procs, new_files, new_segments
        new_procs = descendants(include_infrastructure=False) - procs_before
        new_files = our_shm_files() - files_before
        new_segments = our_segments() - segments_before
        return not new_procs and not new_files and not new_segments

    # A unit test that left nothing needs no collection (a full one takes ~0.3 s with torch and keras
    # imported: most of the unit subset's time); every other test's garbage is collected first.
    if request.node.get_closest_marker("unit") is None or not clean():
        gc.collect()
    deadline = time.monotonic() + LEAK_DEADLINE_S
    while not clean() and time.monotonic() < deadline:
        time.sleep(0.05)
    if new_procs or new_files or new_segments:
        details = [_describe(p) for p in sorted(new_procs)]
        _kill(new_procs)
        for path in new_files:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        pytest.fail(f"test leaked {len(new_procs)} process(es) {details}, {len(new_files)} "
                    f"shared-memory file(s) {sorted(new_files)} and {len(new_segments)} anonymous segment(s) "
                    f"{sorted(new_segments)} (still there {LEAK_DEADLINE_S:.0f} s after the test)")


@pytest.fixture
def shm_dir(tmp_path) -> str:
    """A fresh directory to pass as ``shm_dir=``; checked empty of procpipe files at the end."""
    d = tmp_path / "shm"
    d.mkdir()
    yield str(d)
    wait_until(lambda: not glob.glob(str(d / "procpipe-*")), LEAK_DEADLINE_S, f"no procpipe files left in {d}")
