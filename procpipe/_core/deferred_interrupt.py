"""A Ctrl-C that lands in a finalizer, kept for the consumer's next step.

Python runs a signal's handler in the main thread between two of its bytecodes, wherever it is,
a finalizer (``__del__``) included. A ``KeyboardInterrupt`` raised there cannot propagate: Python
prints "Exception ignored in ..." and goes on, so the user's Ctrl-C would be lost and the training
loop would run on. The finalizer procpipe runs in the consumer's thread, a batch's slot lease
giving its slot back (rings.py), catches it and keeps it (``defer``); the loader raises it at its
next step in the main thread (``raise_deferred``: the iterator's ``next()``, and a device stage's),
before a batch is taken, so no batch is lost either. (In a ``for`` loop the previous batch dies
after ``next()`` returned: the loop body runs once more, then the interrupt comes.)
"""

from __future__ import annotations

import threading


class _Pending:
    interrupt = False  # a finalizer caught a KeyboardInterrupt, not raised yet


def defer() -> None:
    """A ``KeyboardInterrupt`` was caught in a finalizer: raise it at the consumer's next step."""
    _Pending.interrupt = True


def raise_deferred() -> None:
    """Raise the ``KeyboardInterrupt`` a finalizer deferred, if any (once), in the main thread
    only (where Python raises a Ctrl-C's; a device stage's thread also takes batches)."""
    if _Pending.interrupt and threading.current_thread() is threading.main_thread():
        _Pending.interrupt = False
        raise KeyboardInterrupt
