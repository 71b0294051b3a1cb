"""Which start method a Loader's workers get, and starting them without the main script.

``start_method="auto"`` (the default) picks ``"fork"`` while forking is safe
(``fork_safety``: no thread runs but the main one, procpipe's own threads, and numpy's
BLAS pool), else ``"zygote"`` where this process has one (``zygote``: forked at
``import procpipe`` while the process was still safe to fork; workers are forked from it
through multiprocess's forkserver protocol), else ``"forkserver"``. Forking is the fastest
start (nothing is imported or shipped). procpipe's own threads (an earlier loader's coordinator, a device stage) do not
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
the functions are shipped by cloudpickle (``spec_shipping.dump_spec``), which serializes what the
main script defines by value. ``context`` returns contexts whose processes start without importing it.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import multiprocess
from multiprocess import context as _mp_context
from multiprocess import forkserver as _mp_forkserver
from multiprocess import popen_forkserver as _mp_popen_forkserver
from multiprocess import spawn as _mp_spawn
from multiprocess import util as _mp_util

from ..errors import LOADER_WORDS, Words
from . import fork_safety, zygote

AUTO = "auto"
ZYGOTE = "zygote"
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


def resolve(requested: str, warn: bool = True, stacklevel: int = 4) -> str:
    """The start method to use for ``requested`` (``"auto"``: see the module doc); ``warn``: say
    once per process why ``"auto"`` cannot fork (False where no worker starts here), pointing
    ``stacklevel`` frames up from ``_warn_once`` (the default: the caller of the caller of this)."""
    if requested == ZYGOTE:
        return ZYGOTE if zygote.current() is not None else "forkserver"
    if requested != AUTO:
        return requested
    if fork_is_safe():
        return "fork"
    if zygote.current() is not None:
        return ZYGOTE
    if warn:
        _warn_once(fork_safety.why_not_safe() or "forking this process is not safe now", stacklevel)
    return "forkserver"


def _warn_once(why: str, stacklevel: int = 4) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(slow_start_message(why, _words.get()), SlowStartWarning, stacklevel=stacklevel)


def slow_start_message(why: str, words: Words = LOADER_WORDS) -> str:
    """Why ``"auto"`` cannot fork, and what the reader can do, where they are: a notebook's kernel
    runs threads before any cell (importing procpipe first is not theirs to do there), and
    ``words`` names the option as the API the user called does (``procpipe.torch.DataLoader``:
    ``multiprocessing_context``)."""
    option = words.option
    head = (
        f"procpipe: {words.auto} starts workers from a forkserver, not by fork: {why}. The first batch takes "
        "longer (a fresh process imports what the dataset and functions reference, once per process)."
    )
    choose = (
        f"pass {option}='fork' to fork anyway, as torch's DataLoader does (safe if those threads hold no lock the "
        f"workers need), or {option}='forkserver' to choose this start (and silence this). See docs/guide/startup.md."
    )
    if "ipykernel" in sys.modules:  # a notebook (Jupyter): the kernel's threads run before the first cell
        return (
            f"{head} In a notebook the kernel's own threads run before the first cell, so procpipe cannot fork "
            f"the workers nor a zygote to start them from (loaders created in a script that imports procpipe "
            f"before starting threads can). Here, {choose}"
        )
    return (
        f"{head} To fork, or start workers from a zygote: import procpipe before starting threads and before "
        f"libraries that start thread pools, and create loaders before starting threads; or {choose}"
    )


_words: contextvars.ContextVar[Words] = contextvars.ContextVar("procpipe_start_words", default=LOADER_WORDS)


@contextlib.contextmanager
def spoken_as(words: Words) -> Iterator[None]:
    """While it is held, ``SlowStartWarning`` names the options as ``words`` does: an adapter that
    makes a ``Loader`` for its user (``procpipe.torch.DataLoader``) speaks that user's API."""
    token = _words.set(words)
    try:
        yield
    finally:
        _words.reset(token)


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


def leave_forkserver() -> None:
    """In a worker: close the forkserver's alive pipe that multiprocess handed it (a worker of the
    zygote or of a forkserver gets the write end with each fork request; a forked one inherits the
    training process's). A forkserver exits once no process holds that pipe: a stopped worker
    holding it would keep the zygote or the forkserver alive after the training process died,
    and so itself, whose death signal comes when its parent (that server) exits."""
    server = _mp_forkserver._forkserver
    fd = server._forkserver_alive_fd  # (multiprocess's: set by its protocol in the child)
    if fd is not None:
        server._forkserver_alive_fd = None
        try:
            os.close(fd)
        except OSError:
            pass


class ZygoteServer(_mp_forkserver.ForkServer):
    """Connects to this process's zygote (``zygote.current()``) instead of starting a server."""

    def __init__(self, z: zygote.Zygote) -> None:
        super().__init__()
        self._forkserver_address = z.address
        self._forkserver_alive_fd = z.alive_fd
        self._zygote = z

    def ensure_running(self) -> None:
        from multiprocess import resource_tracker

        resource_tracker.ensure_running()
        if zygote.current() != self._zygote:
            raise RuntimeError(
                "procpipe: this process's zygote has exited (was it killed?): no worker can be "
                "forked from it; pass start_method='forkserver' to start workers without it"
            )


class _ZygotePopen(_mp_popen_forkserver.Popen):
    """multiprocess's forkserver client, asking the zygote (the same protocol)."""

    def _launch(self, process_obj: Any) -> None:
        z = zygote.current()
        if z is None:
            raise RuntimeError(
                "procpipe: this process's zygote has exited (was it killed?): no worker can be "
                "forked from it; pass start_method='forkserver' to start workers without it"
            )
        prep = _mp_spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        _mp_context.set_spawning_popen(self)
        try:
            _mp_context.reduction.dump(prep, buf)
            _mp_context.reduction.dump(process_obj, buf)
        finally:
            _mp_context.set_spawning_popen(None)
        self.sentinel, w = ZygoteServer(z).connect_to_new_process(self._fds)
        keep_w = os.dup(w)  # the child watches it: its parent's end of the data pipe
        self.finalizer = _mp_util.Finalize(self, _mp_util.close_fds, (keep_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = _mp_forkserver.read_signed(self.sentinel)


class ZygoteWorker(_WithoutMain, _mp_context.ForkServerProcess):
    """A process forked from this process's zygote (module doc), without the main-script preparation."""

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _ZygotePopen(process_obj)


class _ZygoteContext(_mp_context.ForkServerContext):
    Process = ZygoteWorker


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
    if start_method == ZYGOTE:
        return _ZygoteContext()
    if start_method == "spawn":
        return _SpawnContext()
    if start_method == "fork":
        return _ForkContext()
    return multiprocess.get_context(start_method)
