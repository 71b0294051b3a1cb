"""Which procpipe worker this process is: its index, told by the worker itself.

A worker process learns its index from the pool that starts it (``worker_main``'s
``worker_id``: pool.py's ``LocalPool.start(index)``), and records it here before it loads
the user's dataset. Adapters ask ``worker_index()`` (the torch facade's
``get_worker_info().id``, its per-worker seeds and ``worker_init_fn(id)``) instead of
reading the process's name, which the user's code may change and a process that procpipe
did not start may happen to share. A process forked from a worker (by the user's code)
inherits the index, as torch's ``get_worker_info()`` is inherited.
"""

from __future__ import annotations

__all__ = ["enter_worker", "worker_index"]


class _ThisProcess:
    """The process-wide record (one per process, reset by nothing: a worker stays one)."""

    index: int | None = None


def worker_index() -> int | None:
    """This process's worker index (0 to ``workers - 1``; on a Ray agent, its lane), or None
    outside a procpipe worker (the training process, ``workers=0``, a zygote or forkserver)."""
    return _ThisProcess.index


def enter_worker(index: int) -> None:
    """Record that this process is worker ``index`` (_worker/process.py, as a worker starts)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"procpipe: a worker index is an int >= 0, got {index!r}")
    _ThisProcess.index = index
