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
"""

from __future__ import annotations

import atexit
import signal
import threading
from typing import Any

_exiting = False  # the interpreter is running its exit handlers
_watching = False  # the hook that sets it is registered


def watch_exit() -> None:
    """Register the hook that notes the interpreter's exit. Called after a ``weakref.finalize``
    exists, whose own exit hook is then registered before ours, so ours runs first."""
    global _watching  # noqa: PLW0603 - once per process: the module is the singleton
    if not _watching:
        _watching = True
        atexit.register(_note_exit)


def _note_exit() -> None:
    global _exiting  # noqa: PLW0603 - a process-wide fact, read by every Loader's finalizer
    _exiting = True


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
