"""Exception types procpipe raises in the consumer's process.

Errors raised by user code in a worker (``fn``, ``__getitem__``, ``collate_fn``) are
re-raised with their *original* type; the classes here are for what procpipe itself
detects.
"""

from __future__ import annotations

from collections.abc import Sequence


def summarize_indices(indices: Sequence[object], shown: int = 32) -> str:
    """``indices`` for an error message: all of them when few, else the count, the first and
    the last few (a batch of 20,000 indices would make a 100 KB message)."""
    if not isinstance(indices, (list, tuple)) or len(indices) <= shown:  # (or a streaming task's Block)
        return f"indices {list(indices) if isinstance(indices, tuple) else indices}"
    half = 8
    return (
        f"{len(indices)} indices [{', '.join(map(str, indices[:half]))}, ..., {', '.join(map(str, indices[-half:]))}]"
    )


class ProcpipeError(RuntimeError):
    """Base class of the errors procpipe raises itself."""


class CollateError(ProcpipeError, TypeError):
    """Samples of one batch cannot be stacked into arrays (shape, dtype or structure)."""


class SharedMemoryError(ProcpipeError, MemoryError):
    """The shared-memory directory has too little room for the ring."""


class CacheError(ProcpipeError, ValueError):
    """A sample cannot go into ``Loader(cache=...)``: its structure, dtype or shape differs
    from the first sample's, or it holds something that is not an array or a number."""


class WorkerError(ProcpipeError):
    """A worker failed in a way that cannot be reported with the original exception type.

    Raised when a worker's exception cannot be unpickled in the consumer, and when
    workers keep dying past ``max_worker_restarts``.
    """


class TaskTimeoutError(ProcpipeError, TimeoutError):
    """A batch was still running after ``task_timeout`` seconds on every attempt."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index  # the sample the worker was stuck on (None: while collating)


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; set as ``__cause__`` of re-raised errors."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\n" + self.tb.rstrip() + "\n(end of the worker's traceback)"


class ShardLengthError(ProcpipeError, ValueError):
    """A shard of a ``procpipe.Shards`` with ``lengths=`` yielded a different number of
    records than promised: the epoch would not have the ``len()`` the loader reported."""
