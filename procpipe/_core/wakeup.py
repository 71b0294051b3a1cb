"""``WakePipe``: wake a thread that sleeps in ``select``, from any thread.

A thread that waits on descriptors (the coordinator's loop, a Ray agent's) also needs
waking for events that have no descriptor: a command queued, a ring slot returned, a
batch consumed. The classic answer is a self-pipe: the sleeper watches its read end, and
anyone writes a byte to wake it. Writes never block (a full pipe already means "awake"),
and a write after ``close`` is ignored, so a late wake-up never lands in a reused
descriptor.

``starved`` is the sleeper's flag "I looked and found nothing to do": it sets it before
looking, and an event that frees capacity clears it and wakes it (``wake_if_starved``),
so a release that happens just after the look is not lost, and a busy sleeper costs the
releasing thread no system call.
"""

from __future__ import annotations

import os
from typing import Any


class WakePipe:
    """A non-blocking self-pipe: ``fileno()`` for the selector, ``wake()`` from anywhere."""

    __slots__ = ("_read", "_write", "starved")

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self.starved = False  # set by the sleeper before it looks for work; cleared by a waker

    def fileno(self) -> int:
        """The read end: register it with the selector (EVENT_READ)."""
        return self._read

    def wake(self, _write: Any = os.write) -> None:
        """Make the next (or current) ``select`` return; never blocks, never raises.

        (``os.write`` is bound at definition: a batch's last reference may die as the
        interpreter exits, after this module's globals were cleared, and its slot's release
        wakes the coordinator.)"""
        try:
            _write(self._write, b"\0")
        except OSError:
            pass  # already awake (the pipe is full: BlockingIOError) or closed

    def wake_if_starved(self) -> None:
        """Wake the sleeper only if it said it had nothing to do (capacity has freed up)."""
        if self.starved:
            self.starved = False
            self.wake()

    def drain(self) -> None:
        """Read every wake-up byte waiting (the sleeper, once it is awake)."""
        try:
            while os.read(self._read, 4096):
                pass
        except OSError:
            pass  # empty (BlockingIOError), or closed

    def close(self) -> None:
        """Close both ends; idempotent. A later ``wake`` is ignored instead of writing to a
        descriptor number the process may have reused."""
        fds, self._read, self._write = (self._read, self._write), -1, -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
