"""When forking this process is safe, and making procpipe's own threads safe to fork beside.

A forked child holds a copy of every lock of its parent, in the state it had at the fork,
and only the thread that forked. A lock another thread held then stays held forever in
the child: forking is safe only while no other thread can hold a lock the child will need.
``start_method="auto"`` forks only when every thread of this process is one of these:

- the main thread (or the thread that forks);
- a **procpipe thread** (``start_thread``): the coordinator of an earlier loader, a
  device stage. They run Python code that takes no lock a worker needs, and they wait in
  ``select`` or on queues; the only code of theirs that may hold a native library's lock
  (a CUDA copy, pinning memory) runs inside ``native_region()``. A fork takes the gate
  exclusively (``forking()``): it waits until no procpipe thread is inside such a region,
  and holds new ones at their door until the child exists. (They are parked at a safe point,
  as far as the child is concerned: no lock of theirs is held in it.)
- a thread of **numpy's BLAS pool**, which OpenBLAS makes fork-safe itself
  (``pthread_atfork``). Only those are counted as safe (``SAFE_NATIVE_THREADS``): measured
  when procpipe imports numpy itself (the threads it starts), else asked of OpenBLAS (its
  pool is its thread count less one), and so are the threads of every other OpenBLAS loaded
  (SciPy's has a pool of its own), asked when there are more native threads than that. A
  native thread that was running before procpipe was imported (TensorFlow's, a C library's)
  is *not* safe: it counts against forking.

CPython 3.12+ warns after every fork of a multi-threaded process (``DeprecationWarning``: "This
process is multi-threaded, use of fork() may lead to deadlocks in the child"). For a fork that
this module deems safe, ``forking()`` silences exactly that warning; a fork beside a thread of
the program's still warns, as does the program's own ``os.fork()``.

Anything else (a thread the program started, a native pool that started later: torch's
intra-op pool once a parallel op ran, TensorFlow's) makes ``"auto"`` use the forkserver
(``why_not_safe`` says which). Threads are counted at the OS level (``/proc/self/task``).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def os_thread_count() -> int:
    """Threads of this process as the OS sees them (Python's and native libraries')."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import psutil

        return psutil.Process().num_threads()


def _python_native_split() -> tuple[int, int]:
    """(Python threads, OS threads that are not Python threads)."""
    python = threading.active_count()
    return python, max(0, os_thread_count() - python)


def _openblas_pool() -> int | None:
    """Threads of the OpenBLAS pools in this process (each library's thread count less the
    caller), or None if none can be asked. Every OpenBLAS loaded has a pool of its own: numpy's,
    and SciPy's (which Keras on JAX imports, and ``scipy.linalg``), each fork-safe alike."""
    try:
        with open("/proc/self/maps") as f:
            libraries = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", f.read())))
    except OSError:
        return None
    if not libraries:
        return None
    import ctypes

    pools = []
    for path in libraries:
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in (
            "scipy_openblas_get_num_threads64_",
            "scipy_openblas_get_num_threads",
            "openblas_get_num_threads64_",
            "openblas_get_num_threads",
        ):
            get = getattr(library, symbol, None)
            if get is not None:
                pools.append(max(0, int(get()) - 1))
                break
    return sum(pools) if pools else None


def _measure_safe_native() -> tuple[int, str]:
    """The native threads known to be fork-safe, and how that was established (module doc)."""
    if "numpy" not in sys.modules:
        before = _python_native_split()[1]
        import numpy  # (procpipe imports it anyway: its BLAS pool starts here)
        import numpy.random  # noqa: F401

        return max(0, _python_native_split()[1] - before), "measured: the threads importing numpy started"
    pool = _openblas_pool()
    if pool is not None:
        return pool, "OpenBLAS's pool size"
    return 0, "none (numpy was imported before procpipe and its BLAS pool size is unknown)"


SAFE_NATIVE_THREADS, SAFE_NATIVE_HOW = _measure_safe_native()

# ------------------------------------------------------------------ procpipe's own threads
_registry_lock = threading.Lock()
_procpipe_threads: set[int] = set()  # idents of live procpipe threads
_gate = threading.Condition()
_in_native = 0  # procpipe threads inside native_region()
_forking: int | None = None  # ident of the thread forking now


def start_thread(target: Callable[..., Any], name: str, args: tuple = ()) -> threading.Thread:
    """Start a daemon thread that is procpipe's: it does not stop ``"auto"`` from forking
    (module doc). Its code must take no lock a worker needs, except inside ``native_region()``."""

    def run() -> None:
        ident = threading.get_ident()
        with _registry_lock:
            _procpipe_threads.add(ident)
        started.set()
        try:
            target(*args)
        finally:
            with _registry_lock:
                _procpipe_threads.discard(ident)

    started = threading.Event()
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    started.wait()  # registered before anyone counts threads
    return thread


@contextmanager
def native_region() -> Iterator[None]:
    """Around code of a procpipe thread that may take a native library's lock (a CUDA copy):
    no fork happens while it runs, and it does not start while a fork is under way."""
    global _in_native
    me = threading.get_ident()
    with _gate:
        while _forking is not None and _forking != me:
            _gate.wait()
        _in_native += 1
    try:
        yield
    finally:
        with _gate:
            _in_native -= 1
            _gate.notify_all()


# CPython 3.12+ says this after every fork of a process that has more than one OS thread.
FORK_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks in the child\."


@contextmanager
def _without_fork_warning() -> Iterator[None]:
    """Silence CPython's fork warning (``FORK_WARNING``) for a fork this module knows is safe:
    every other thread is procpipe's, parked by ``forking()``, numpy's BLAS pool (fork-safe by
    ``pthread_atfork``) or the main thread (module doc). A fork beside a thread of the program's
    (``start_method="fork"`` forced) still warns: that warning is the program's to see."""
    if sys.version_info < (3, 12) or why_not_safe() is not None:
        yield
        return
    # Only this message, only for this fork: catch_warnings swaps in a copy of the filter list
    # with one entry more for the fork's duration (milliseconds), and puts the list back. On
    # 3.12 and 3.13 the list is the process's: another thread's own catch_warnings overlapping
    # this window could keep the entry after it (this one message, silenced); with 3.14's
    # context-aware warnings (the default in free-threaded builds) it is this thread's only.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FORK_WARNING, category=DeprecationWarning)
        yield


@contextmanager
def forking() -> Iterator[None]:
    """Held around ``fork()``: one fork at a time, and none while a procpipe thread is
    inside a native region (module doc); CPython's fork warning silenced when the fork is
    safe (``_without_fork_warning``)."""
    global _forking
    me = threading.get_ident()
    with _gate:
        while _forking is not None or _in_native:
            _gate.wait()
        _forking = me
    try:
        with _without_fork_warning():
            yield
    finally:
        with _gate:
            _forking = None
            _gate.notify_all()


def _reset_after_fork() -> None:
    """In a forked child, only the forking thread exists: no procpipe thread, no fork under way."""
    global _gate, _in_native, _forking, _registry_lock
    _gate = threading.Condition()
    _registry_lock = threading.Lock()
    _in_native = 0
    _forking = None
    _procpipe_threads.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


# ------------------------------------------------------------------ the census
def foreign_threads() -> list[str]:
    """The Python threads of this process that are neither the calling, the main, nor a procpipe thread."""
    me = threading.get_ident()
    main = threading.main_thread().ident
    with _registry_lock:
        ours = set(_procpipe_threads)
    return [t.name for t in threading.enumerate() if t.ident not in ours and t.ident not in (me, main)]


def why_not_safe() -> str | None:
    """Why forking this process now is not safe (None: it is; module doc)."""
    foreign = foreign_threads()
    if foreign:
        return (
            f"{len(foreign)} thread(s) not started by procpipe are running "
            f"({', '.join(repr(n) for n in foreign[:4])}{', ...' if len(foreign) > 4 else ''})"
        )
    native = _python_native_split()[1]
    if native > SAFE_NATIVE_THREADS:
        # (a BLAS pool started since procpipe was imported, SciPy's say, is as safe: asked only now)
        safe = max(SAFE_NATIVE_THREADS, _openblas_pool() or 0)
        if native <= safe:
            return None
        unknown = native - safe
        frameworks = [m for m in ("tensorflow", "jax", "torch", "ray", "grpc") if m in sys.modules]
        hint = f"; imported: {', '.join(frameworks)}" if frameworks else ""
        return (
            f"{unknown} native thread(s) beyond numpy's BLAS pool are running (a library's thread pool, "
            f"e.g. torch's intra-op pool after a parallel op, TensorFlow's{hint})"
        )
    return None


def fork_is_safe() -> bool:
    """Whether ``"auto"`` may fork now (module doc)."""
    return why_not_safe() is None
