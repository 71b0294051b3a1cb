"""A worker's reply that the loader's process cannot unpickle: the error it becomes.

Replies are pickled in the worker and unpickled by the coordinator thread. A sample can
pickle in the worker and still fail to unpickle here (a ``__reduce__`` whose call fails,
a ``__setstate__`` that raises, a class the main process cannot import). Such a reply
must not stop the coordinator (its loop would die and the loader with it): it becomes
the error of its batch, a ``BatchFailed`` reply as the worker would have sent
(``unreadable_reply``), so the usual path names the batch, skips it with
``on_error="skip"``, and the next epoch works.

Naming the sample: the reply is decoded again with the pure-Python unpickler, each
object whose reconstruction fails replaced by a marker, and the marker is looked for in
the inline leaves of the batch's layout (collate.py): a leaf list with one entry per
sample kept gives the sample's position. Anything else names the batch only.
"""

from __future__ import annotations

import io
import pickle
import traceback
from collections.abc import Callable
from typing import Any, ClassVar

import dill

from .._core import tree, wire
from .._core.messages import BatchDone, BatchFailed, ErrorInfo
from .._core.notes import add_note


class _Unreadable:
    """Stands for an object whose unpickling failed (diagnosis only)."""


class _Diagnose(pickle._Unpickler):  # the pure-Python unpickler: its opcodes can be overridden
    # The unpickler's value stack, set by ``load()`` (typeshed does not declare it).
    stack: list[Any]
    # ``Any``: the handlers take the unpickler they are overridden on (this subclass), not ``_Unpickler``.
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)

    def _reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        try:
            stack[-1] = stack[-1](*args)
        except Exception:  # noqa: BLE001 - a user object's reconstruction can raise anything; the marker stands in
            stack[-1] = _Unreadable()

    dispatch[pickle.REDUCE[0]] = _reduce


def _contains_unreadable(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _Unreadable):
        return True
    if depth > 8:
        return False
    if isinstance(value, (list, tuple)):
        return any(_contains_unreadable(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_contains_unreadable(v, depth + 1) for v in value.values())
    return False


def _position(node: Any, samples: int) -> int | None:
    """Position of the first sample of ``samples`` with an unreadable object in the layout ``node``."""
    if not isinstance(node, list) or not node:
        return None
    if node[0] == tree.INLINE:
        value = node[1]
        if isinstance(value, list) and len(value) == samples:
            return next((p for p, v in enumerate(value) if _contains_unreadable(v)), None)
        return None
    if node[0] in (tree.DICT, tree.SEQ) and len(node) == 3:
        for child in node[2]:
            found = _position(child, samples)
            if found is not None:
                return found
    return None


def unreadable_index(data: bytes, kept: list[int]) -> int | None:
    """The index (of ``kept``, the batch's samples in order) that made the ``ok`` reply ``data``
    fail to unpickle; None if it cannot be told."""
    if len(kept) == 1:
        return kept[0]
    try:
        message = wire.from_wire(_Diagnose(io.BytesIO(data)).load())
    except Exception:  # noqa: BLE001 - the diagnosis is best effort
        return None
    if not isinstance(message, BatchDone):
        return None
    position = _position(message.layout, len(kept))
    return None if position is None else kept[position]


def unreadable_reply(task_id: int, worker: int, data: bytes, exc: Exception, kept: list[int]) -> BatchFailed:
    """The ``BatchFailed`` reply that stands for a reply to task ``task_id``
    that raised ``exc`` when unpickled: ``exc``, with a note saying what happened."""
    index = unreadable_index(data, kept)
    what = f"index {index}" if index is not None else f"one of indices {kept}"
    add_note(
        exc,
        f"procpipe: the reply of worker {worker} holding {what} could not be unpickled in the "
        "loader's process (it pickled in the worker). Check the sample's __reduce__ / __setstate__, "
        "and that its class can be imported in the main process.",
    )
    try:
        exc_bytes = dill.dumps(exc, protocol=dill.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - then the error is rebuilt from its type name and message
        exc_bytes = None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return BatchFailed(
        task_id, ErrorInfo(index, exc_bytes, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb), 0.0
    )
