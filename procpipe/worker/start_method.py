"""Which start method a Loader's workers get, and starting them without the main script.

``start_method="auto"`` (the default) picks ``"fork"`` when the calling process runs no
thread but its main one and those that existed when procpipe was imported, else
``"forkserver"``. Forking is the fastest start (nothing is imported or shipped) and is
safe while no other thread can hold a lock the child would inherit or leave a thread
pool the child cannot use. Threads are counted at the OS level (``/proc/self/task``), so
native pools (torch's OpenMP intra-op pool once a parallel op ran) count as well as
Python's. The baseline taken at import is numpy's BLAS pool, which OpenBLAS makes
fork-safe itself (``pthread_atfork``); a script that imports torch but has not run a
parallel op yet has no more threads than that. The choice is made once per loader: its
workers started later (replacing a dead one, or added by ``workers="auto"``) are forked
the same way, from the coordinator thread, as torch's DataLoader forks each epoch's
workers from a training process that runs threads by then. Native threads that were
already running when procpipe was imported count in the baseline: import procpipe early.

With ``"forkserver"`` and ``"spawn"``, multiprocess makes every new process import the
main script again (as ``__mp_main__``) before it runs anything: a second or more when
the script imports torch, and the cause of the classic failure of a script without an
``if __name__ == "__main__":`` guard. procpipe's workers do not need it: the dataset and
the functions are shipped by dill, which serializes what the main script defines by
value. ``context`` returns contexts whose processes start without importing it.
"""
from __future__ import annotations

import os
import threading
from typing import Any

import multiprocess
from multiprocess import context as _mp_context
from multiprocess import spawn as _mp_spawn

AUTO = "auto"
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")
_launching = threading.local()  # .without_main: this thread is starting a procpipe worker
_install_lock = threading.Lock()
_installed = False


def os_thread_count() -> int:
    """Threads of this process as the OS sees them (Python's and native libraries')."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import psutil

        return psutil.Process().num_threads()


# OS threads when procpipe was imported, Python threads but the main one left out
# (numpy, imported first, has started its BLAS pool by then).
_BASELINE_THREADS = os_thread_count() - (threading.active_count() - 1)


def fork_is_safe() -> bool:
    """No thread runs in this process but the main one and the import-time baseline."""
    return threading.active_count() == 1 and os_thread_count() <= _BASELINE_THREADS


def resolve(requested: str) -> str:
    """The start method to use for ``requested`` (``"auto"``: see the module doc)."""
    if requested != AUTO:
        return requested
    return "fork" if fork_is_safe() else "forkserver"


def _install() -> None:
    """Wrap multiprocess's preparation data so that, while this thread starts a procpipe
    worker (and only then), it leaves out the main module. Other processes the program
    starts with multiprocess are unaffected."""
    global _installed
    with _install_lock:
        if _installed:
            return
        original = _mp_spawn.get_preparation_data

        def get_preparation_data(name: str) -> dict[str, Any]:
            data = original(name)
            if getattr(_launching, "without_main", False):
                for key in _MAIN_KEYS:
                    data.pop(key, None)
            return data

        _mp_spawn.get_preparation_data = get_preparation_data
        _installed = True


class _WithoutMain:
    """Mixin for a process class: ``start()`` without the main-module preparation."""

    def start(self) -> None:
        _install()
        _launching.without_main = True
        try:
            super().start()  # type: ignore[misc]
        finally:
            _launching.without_main = False


class ForkServerWorker(_WithoutMain, _mp_context.ForkServerProcess):
    """A forkserver process that does not import the main script (module doc)."""


class SpawnWorker(_WithoutMain, _mp_context.SpawnProcess):
    """A spawned process that does not import the main script (module doc)."""


class _ForkServerContext(_mp_context.ForkServerContext):
    Process = ForkServerWorker


class _SpawnContext(_mp_context.SpawnContext):
    Process = SpawnWorker


def context(start_method: str) -> Any:
    """The multiprocess context for ``start_method`` (resolved: not ``"auto"``)."""
    if start_method == "forkserver":
        return _ForkServerContext()
    if start_method == "spawn":
        return _SpawnContext()
    return multiprocess.get_context(start_method)
