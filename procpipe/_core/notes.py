"""`add_note`: PEP 678 exception notes on every Python procpipe supports.

procpipe adds a note to the exceptions it re-raises, saying where the error came from (which
worker, batch, shard or record). `BaseException.add_note` exists from Python 3.11 on;
`requires-python` is 3.10. On 3.10 the note goes into the exception's `__notes__` list, the very
attribute 3.11's `add_note` fills (PEP 678), rather than into its message:

- the exception stays what the user's code raised: its `args`, `str()` and pickling are unchanged
  (rewriting `args` would break exceptions whose `args` are structured, such as `OSError(errno,
  strerror)` or a `KeyError`'s key, and the ones whose `__init__` takes other arguments than its
  `args` when they are unpickled after crossing from a worker);
- code that reads the notes (procpipe's tests, the user's `except` clauses, pytest) reads them
  from one place on every version, and they travel with the exception through pickle (they live in
  its `__dict__`, on 3.10 and 3.11 alike);
- the `exceptiongroup` backport, which pytest and anyio install on 3.10, prints `__notes__` in
  tracebacks; the plain 3.10 traceback does not show them (the price of leaving the message alone).

Error paths only: never called per batch.
"""

from __future__ import annotations

import sys

__all__ = ["add_note"]


def _add_note_by_attribute(exc: BaseException, note: str) -> None:
    """Python 3.10: append `note` to `exc.__notes__`, as 3.11's `add_note` does."""
    if not isinstance(note, str):
        raise TypeError(f"a note must be a str, not {type(note).__name__} (as BaseException.add_note requires)")
    notes = exc.__dict__.get("__notes__")
    if notes is None:
        notes = exc.__dict__["__notes__"] = []
    elif not isinstance(notes, list):
        raise TypeError(f"cannot add a note: {type(exc).__name__}.__notes__ is a {type(notes).__name__}, not a list")
    notes.append(note)


if sys.version_info >= (3, 11):

    def add_note(exc: BaseException, note: str) -> None:
        """Add `note` to `exc`'s PEP 678 notes (`BaseException.add_note`, Python 3.11+)."""
        exc.add_note(note)

else:
    add_note = _add_note_by_attribute
