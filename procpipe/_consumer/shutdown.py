"""Closing a Loader's engine, shielded from a Ctrl-C that would cut the cleanup short.

A Ctrl-C ends the training loop with ``KeyboardInterrupt``; the interpreter then runs its
exit handlers, among them ``weakref.finalize``'s, which close every loader still open
(ending its workers, removing its ``/dev/shm`` files). A second Ctrl-C landing inside that
close would cut it short (files left behind) and make Python print ``Exception ignored in
atexit callback ... KeyboardInterrupt`` or a traceback ending in ``lost sys.stderr``.
So a close in the main thread holds a Ctrl-C back until it is done (a close takes a fraction
of a second: busy workers are told to leave their tasks, pool.stop_all). After that, a Ctrl-C
held back is delivered again, except while the interpreter exits (what the user asked for is
already happening).

At exit, the loaders still open are closed by procpipe's own exit hook, *before*
multiprocess's: that one terminates every daemonic child process, the workers included,
and a coordinator still running would take those deaths for crashes and start
replacements, from a forkserver whose socket multiprocess's hook then removes
("worker 0 could not be replaced ([Errno 2] No such file or directory)", printed by a
program that had already failed). The hooks run last registered first, so ours is
registered after multiprocess's (``watch_exit`` imports it first).
"""

from __future__ import annotations

import atexit
import signal
import threading
import weakref
from typing import Any

_exiting = False  # the interpreter is running its exit handlers
_watching = False  # the hook that sets it is registered
_open: list[weakref.finalize] = []  # the finalizers of the loaders this process made (dead ones pruned)


def watch_exit(finalizer: weakref.finalize | None = None) -> None:
    """Register the hook that notes the interpreter's exit and closes the loaders still open
    (``finalizer``: a new loader's), once per process. Called after a ``weakref.finalize``
    exists, and after importing multiprocess, whose exit hooks are then registered before
    ours, so ours runs first (module doc)."""
    global _watching  # noqa: PLW0603 - once per process: the module is the singleton
    if finalizer is not None:
        _open[:] = [f for f in _open if f.alive]
        _open.append(finalizer)
    if not _watching:
        import multiprocess.util  # noqa: F401 - its exit hook registered first, so it runs after ours

        _watching = True
        atexit.register(_note_exit)


def _note_exit() -> None:
    """At exit: note it, then close the loaders still open, before multiprocess ends their workers."""
    global _exiting  # noqa: PLW0603 - a process-wide fact, read by every Loader's finalizer
    _exiting = True
    for finalizer in _open:
        finalizer()  # (a finalizer runs once: the weakref module's own exit hook skips it after this)
    _open.clear()


def close_engine(coordinator: Any) -> None:
    """A Loader's finalizer: close its coordinator (None: ``workers=0``, nothing to do), with
    a Ctrl-C held back until the close is done (module doc)."""
    if coordinator is None:
        return
    if threading.current_thread() is not threading.main_thread():
        coordinator.close()  # (only the main thread receives Ctrl-C)
        return
    held: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    except (ValueError, TypeError):  # no signal module state (interpreter teardown)
        coordinator.close()
        return
    try:
        coordinator.close()
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and not _exiting and previous not in (signal.SIG_IGN, None):
        signal.raise_signal(signal.SIGINT)  # as if pressed just now, once the loader is closed
