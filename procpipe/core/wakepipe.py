"""A wake pipe: one thread tells another, blocked in ``select``/``wait`` on a file
descriptor, that something is waiting for it (a reply in an inbox, a lane's end).

A non-blocking ``os.pipe``: ``poke`` writes a byte and never blocks (a full pipe is
already readable; a closed one means the reader is gone), ``drain`` empties it before
the reader looks at what it was woken for, so a poke after the drain always wakes it again.
"""
from __future__ import annotations

import os


class WakePipe:
    """A non-blocking pipe whose read end a selector watches (``fileno``)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.closed = False

    def fileno(self) -> int:
        """The read end: readable once ``poke`` was called since the last ``drain``."""
        return self.read_fd

    def poke(self) -> None:
        """Wake the reader (any thread; never blocks, never raises)."""
        if self.closed:  # (its fd number may belong to another file by now)
            return
        try:
            os.write(self.write_fd, b"\0")
        except OSError:  # (BlockingIOError included) already readable: pipe full; or closed
            pass

    def drain(self) -> None:
        """Read every byte waiting (the reader's thread), so that the next ``poke`` wakes it again."""
        try:
            while os.read(self.read_fd, 4096):
                pass
        except OSError:  # (BlockingIOError included) empty now; or closed
            pass

    def close(self) -> None:
        """Close both ends (once; a later ``poke`` or ``drain`` does nothing)."""
        if self.closed:
            return
        self.closed = True
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
