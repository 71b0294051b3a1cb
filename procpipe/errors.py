"""Exception types procpipe raises in the consumer's process.

Errors raised by user code in a worker (``fn``, ``__getitem__``, ``collate_fn``) are
re-raised with their *original* type; the classes here are for what procpipe itself
detects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


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


class Words(NamedTuple):
    """How an error names the options and objects of the API the user called (``Loader``'s by
    default; ``procpipe.torch.DataLoader`` has its own: a DataLoader user has no ``start_method``)."""

    owner: str = "procpipe.Loader"
    objects: str = "the source, fn or collate_fn"
    option: str = "start_method"  # the start-method option
    auto: str = "start_method='auto'"  # the default, which forks when it can
    lazily: str = "inside __getitem__ or fn"  # where to open what cannot be pickled


LOADER_WORDS = Words()


class ShippingError(ProcpipeError, TypeError):
    """The dataset or a function cannot be pickled for workers that are not forked.

    ``start_method``: the workers' (resolved); ``detail``: the pickler's error; ``culprit``: the
    innermost attribute found to refuse pickling (``"an attribute 'conn' holds a socket.socket"``;
    "" if none was found); ``inherited_only``: it is
    a ``multiprocessing`` synchronization object, which reaches a child only by inheritance;
    ``why_not_forked``: why ``"auto"`` did not fork (None: the user chose the method); ``words``:
    the vocabulary of the API the user called. The message's first sentence names the cause.
    """

    def __init__(
        self,
        start_method: str,
        detail: str,
        *,
        culprit: str = "",
        inherited_only: bool = False,
        why_not_forked: str | None = None,
        words: Words = LOADER_WORDS,
    ) -> None:
        self.start_method = start_method
        self.detail = detail
        self.culprit = culprit
        self.inherited_only = inherited_only
        self.why_not_forked = why_not_forked
        self.words = words
        super().__init__(self._message())

    def reworded(self, *, why_not_forked: str | None = None, words: Words | None = None) -> ShippingError:
        """The same error, told why ``"auto"`` did not fork, or in another API's words."""
        return ShippingError(
            self.start_method,
            self.detail,
            culprit=self.culprit,
            inherited_only=self.inherited_only,
            why_not_forked=why_not_forked if why_not_forked is not None else self.why_not_forked,
            words=words or self.words,
        )

    def _message(self) -> str:
        w = self.words
        what = f"{self.culprit}, which" if self.culprit else "they hold an object that"
        head = f"{w.owner} cannot send {w.objects} to its workers: {what} cannot be pickled ({self.detail})."
        if self.why_not_forked:
            how = (
                f"The workers are not forked (forked workers would inherit it, nothing pickled): {w.auto} "
                f"starts them with {self.start_method!r} because {self.why_not_forked}."
            )
        else:
            how = f"Workers started with {w.option}={self.start_method!r} get it pickled."
        if self.inherited_only:
            fix = (
                "It is a multiprocessing synchronization object (Value, Array, Lock, Event, Semaphore...), which "
                f"reaches a child process only by inheritance: pass {w.option}='fork', or create it in the worker."
            )
        else:
            fix = (
                f"Open sockets, files, locks and connections in the worker instead ({w.lazily}, on first use), "
                f"or pass {w.option}='fork'"
                + (", if that thread holds no lock the workers need." if self.why_not_forked else ".")
            )
        return f"{head} {how} {fix}"


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
    """Carries a worker's formatted traceback; set as ``__cause__`` of re-raised errors.

    Python prints the cause first, so the first line of the output is this one's: ``headline``
    (the worker's exception, its type and the first line of its message, and where it was
    raised) puts the line that matters there, before the tracebacks."""

    def __init__(self, tb: str, headline: str = "") -> None:
        super().__init__(tb)
        self.tb = tb
        self.headline = headline

    def __str__(self) -> str:
        head = f"{self.headline}\n(the worker's traceback, then the same exception raised here)"
        return (head if self.headline else "") + "\n\n" + self.tb.rstrip() + "\n(end of the worker's traceback)"

    @staticmethod
    def headline_of(type_name: str, message: str, where: str) -> str:
        """``"TypeError in worker 1 while loading index 5: <the message's first line>"``."""
        lines = [line for line in message.splitlines() if line.strip()]
        short = type_name.removeprefix("builtins.")
        return f"{short} {where}: {lines[0]}" if lines else f"{short} {where}"


class ShardLengthError(ProcpipeError, ValueError):
    """A shard of a ``procpipe.Shards`` with ``lengths=`` yielded a different number of
    records than promised: the epoch would not have the ``len()`` the loader reported."""


# ---------------------------------------------------------------------- procpipe.ray (raised to the user)
class NodeLostError(RuntimeError):
    """``procpipe.ray``: agents were lost more often than ``Backend(max_node_restarts=...)`` allows,
    or none could start."""


class ObjectStoreError(RuntimeError):
    """``procpipe.ray``: the batches the loader keeps in flight would not fit in the Ray object store."""
