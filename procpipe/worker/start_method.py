"""Which start method a Loader's workers get, and starting them without the main script.

``start_method="auto"`` (the default) picks ``"fork"`` while forking is safe
(``fork_safety``: no thread runs but the main one, procpipe's own threads, and numpy's
BLAS pool), else ``"forkserver"``. Forking is the fastest start (nothing is imported or
shipped). procpipe's own threads (an earlier loader's coordinator, a device stage) do not
prevent it: every fork of a procpipe worker holds ``fork_safety.forking()``, so none of
them is inside native code then. A second loader therefore forks like the first. When
``"auto"`` cannot fork, it says why, once per process (``SlowStartWarning``), with the fix.
The choice is made once per loader: its workers started later (replacing a dead one, or
added by ``workers="auto"``) start the same way, as torch's DataLoader forks each epoch's
workers from a training process that runs threads by then.

With ``"forkserver"`` and ``"spawn"``, multiprocess makes every new process import the
main script again (as ``__mp_main__``) before it runs anything: a second or more when
the script imports torch, and the cause of the classic failure of a script without an
``if __name__ == "__main__":`` guard. procpipe's workers do not need it: the dataset and
the functions are shipped by dill, which serializes what the main script defines by
value. ``context`` returns contexts whose processes start without importing it.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any

import multiprocess
from multiprocess import context as _mp_context
from multiprocess import spawn as _mp_spawn

from . import fork_safety

AUTO = "auto"
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")
_launching = threading.local()  # .without_main: this thread is starting a procpipe worker
_install_lock = threading.Lock()
_installed = False


class SlowStartWarning(UserWarning):
    """``start_method="auto"`` could not fork: workers start from a forkserver (said once per process)."""


_warned = False


def fork_is_safe() -> bool:
    """Whether ``"auto"`` may fork now (``fork_safety``)."""
    return fork_safety.fork_is_safe()


def resolve(requested: str, warn: bool = True) -> str:
    """The start method to use for ``requested`` (``"auto"``: see the module doc); ``warn``: say
    once per process why ``"auto"`` cannot fork (False where no worker starts here)."""
    if requested != AUTO:
        return requested
    if fork_is_safe():
        return "fork"
    if warn:
        _warn_once(fork_safety.why_not_safe() or "forking this process is not safe now")
    return "forkserver"


def _warn_once(why: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"procpipe: start_method='auto' starts workers from a forkserver, not by fork: {why}. "
        "The first batch takes longer (a fresh process imports what the dataset and functions reference, "
        "once per process). To fork: create loaders before starting threads, and import procpipe before "
        "libraries that start thread pools; or pass start_method='fork' if those threads hold no lock the "
        "workers need, or start_method='forkserver' to choose it (and silence this). See docs/guide/startup.md.",
        SlowStartWarning, stacklevel=4)


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


class ForkWorker(_mp_context.ForkProcess):
    """A forked process; the fork waits until no procpipe thread is in native code (``fork_safety``)."""

    def start(self) -> None:
        with fork_safety.forking():
            super().start()


class ForkServerWorker(_WithoutMain, _mp_context.ForkServerProcess):
    """A forkserver process that does not import the main script (module doc)."""


class SpawnWorker(_WithoutMain, _mp_context.SpawnProcess):
    """A spawned process that does not import the main script (module doc)."""


class _ForkContext(_mp_context.ForkContext):
    Process = ForkWorker


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
    if start_method == "fork":
        return _ForkContext()
    return multiprocess.get_context(start_method)
