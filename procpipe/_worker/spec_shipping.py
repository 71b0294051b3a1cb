"""Shipping a ``WorkerSpec`` to workers that do not inherit it (every start method but ``"fork"``).

``ship`` is all of it, in the calling process: the spec pickled once (``dump_spec``: cloudpickle,
dill as the fallback), or a ``ShippingError`` naming what refuses (``culprit``); the pickle written
into a sealed segment of shared memory (a ``ShippedSpec``: what each worker receives as it starts,
with the descriptors pickled inside it, shm.py ``shipping``); and the modules for a forkserver to
preload (``preload_list``). A worker loads it back with ``load_spec`` (process.py ``worker_main``).

Which modules a forkserver preloads: those the shipped dataset and functions reference. A worker
started from the forkserver unpickles the loader's spec, which imports every module a class or
function in it lives in. Imported once in the server instead (preload.py), they cost nothing per
worker. Only those: a process that imported TensorFlow or torch for its training loop does not
make a numpy-only dataset's workers wait for them (10 s for TensorFlow). The list is read off the
pickle itself (``referenced_modules``: its ``GLOBAL`` / ``STACK_GLOBAL`` opcodes, and the modules
cloudpickle and dill pickle by reference: the argument of their import function), and ordered as
the parent imported them (``sys.modules`` keeps that order), so that a module whose import depends
on another's having run first (a plugin registry, a post-import hook) is imported after it, as in
the parent. Modules imported only inside a function body are not referenced: each worker imports
those itself.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import sys
import types
from typing import Any, NamedTuple, cast

import cloudpickle
import dill
import numpy as np

from .._core.shm import Segments, SharedFd, close_fd, map_fd, receiving, seal_writes, shipping
from ..errors import ShippingError
from .worker_spec import WorkerSpec

_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})
_GET_OPS = frozenset({"BINGET", "LONG_BINGET", "GET"})
_NO_STACK_OPS = frozenset({"FRAME", "PROTO", "STOP"})
# (module, name) of the functions cloudpickle's and dill's pickles call to import a module pickled by reference
_IMPORT_MODULE = frozenset({("cloudpickle.cloudpickle", "subimport"), ("dill._dill", "_import_module")})
# Already imported by every worker: never worth listing.
_ALWAYS_THERE = frozenset(
    {
        "__main__",
        "builtins",
        "__builtin__",
        "copyreg",
        "dill",
        "dill._dill",
        "cloudpickle",
        "cloudpickle.cloudpickle",
        "numpy",
    }
)


def referenced_modules(data: bytes) -> set[str]:
    """The modules a pickle imports when it is loaded (module doc)."""
    modules: set[str] = set()
    memo: dict[int, str | None] = {}
    recent: list[str | None] = [None, None]  # the last two values pushed (None: not a string)
    want_module = False  # the next string is the argument of an _IMPORT_MODULE function
    for opcode, arg, _ in pickletools.genops(data):
        name = opcode.name
        value: str | None = None
        if name in _STRING_OPS:
            value = arg
        elif name in _GET_OPS:
            value = memo.get(cast(int, arg))  # (pickletools types every argument as Any | None)
        elif name == "MEMOIZE":
            memo[len(memo)] = recent[-1]
            continue
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[cast(int, arg)] = recent[-1]
            continue
        elif name in _NO_STACK_OPS:
            continue
        elif name == "STACK_GLOBAL" or name == "GLOBAL":
            module, attr = (recent[-2], recent[-1]) if name == "STACK_GLOBAL" else str(arg).split(" ", 1)
            if module is not None:
                modules.add(module)
                want_module = (module, attr) in _IMPORT_MODULE
            recent.append(None)
            del recent[0]
            continue
        if value is not None and want_module:
            modules.add(value)
            want_module = False
        recent.append(value)
        del recent[0]
    return modules


def preload_list(data: bytes) -> list[str]:
    """The modules for a forkserver to preload before it forks workers that unpickle ``data``:
    those it references that this process has imported, in the order it imported them."""
    wanted = referenced_modules(data) - _ALWAYS_THERE
    return [name for name in list(sys.modules) if name in wanted]


class _SpecPickler(dill.Pickler):
    """dill, except that importable modules are always pickled by reference (the fallback of
    ``dump_spec``).

    dill pickles a module that is not under site-packages or the stdlib (an editable
    install such as procpipe itself, or the user's own helper module) *with its whole
    ``__dict__``*, so a lambda or ``__main__`` function that merely references
    ``procpipe`` or ``mylib`` fails (thread locals, locks) or clobbers the worker's copy.
    """

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if (
            isinstance(obj, types.ModuleType)
            and id(obj) not in self.memo
            and obj.__name__ != "__main__"
            and sys.modules.get(obj.__name__) is obj
        ):
            self.framer.commit_frame()
            self.save_reduce(dill._dill._import_module, (obj.__name__,), obj=obj)
            return
        super().save(obj, save_persistent_id)


class ShippedSpec(NamedTuple):
    """A ``WorkerSpec`` as a worker that is not forked receives it: the pickle, in a sealed
    segment of shared memory, and the descriptors pickled inside it (shm.py ``shipping``),
    both passed as the worker process's arguments."""

    data: SharedFd
    nbytes: int
    fds: list[SharedFd]


def dump_spec(spec: WorkerSpec) -> tuple[bytes, list[SharedFd]]:
    """``spec`` pickled for workers that do not inherit it (every start method but ``"fork"``),
    and the shared-memory descriptors it holds (a cache's), which travel beside the pickle.

    cloudpickle first: it pickles what an importable module defines by reference (the worker
    imports the module) and what the main script or a notebook defines (``__main__``), or a
    function body, by value, as the script runs it: a class with its whole hierarchy of
    ``__main__`` bases, ``typing.Generic`` bases and their ``TypeVar``s (torch's ``Dataset`` is
    ``Generic[T_co]``), dataclasses, enums, closures, lambdas in class attributes. A worker started
    by the zygote, a forkserver or spawn never imports the main script (start_method.py), so these
    by-value copies are all it has of them. dill is the fallback for the objects cloudpickle refuses
    and dill can pickle (a ``threading.Lock``, an open file); the error raised when both refuse is
    cloudpickle's, which names the object.
    """
    with shipping() as fds:
        data = dump_value(spec)
    return data, fds


def dump_value(value: Any) -> bytes:
    """``value`` pickled as ``dump_spec`` pickles the spec: cloudpickle, else dill."""
    try:
        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as refused:  # noqa: BLE001 - cloudpickle refuses: dill may not (a lock, an open file)
        try:
            buffer = io.BytesIO()
            _SpecPickler(buffer, protocol=dill.HIGHEST_PROTOCOL, recurse=True).dump(value)
        except Exception:  # noqa: BLE001 - both refuse: cloudpickle's error says why (the caller words it)
            raise refused from None
        return buffer.getvalue()


def load_spec(spec: WorkerSpec | ShippedSpec) -> WorkerSpec:
    """The spec a worker was given: itself (forked), or loaded from its ``ShippedSpec``."""
    if isinstance(spec, WorkerSpec):
        return spec
    mapped = map_fd(spec.data.fd, spec.nbytes, populate=False, writable=False)
    close_fd(spec.data.fd)
    try:
        with receiving(spec.fds):
            return dill.loads(mapped)
    finally:
        mapped.close()


def ship(spec: WorkerSpec, start_method: str, segments: Segments) -> tuple[ShippedSpec, list[str]]:
    """``spec`` for workers started by ``start_method`` (not ``"fork"``): pickled (``serialize_spec``:
    a ``ShippingError`` if it cannot be), written into a sealed segment of ``segments``
    (``write_spec``); with it, the modules for a forkserver to preload (``preload_list``)."""
    data, fds = serialize_spec(spec, start_method)
    return write_spec(data, fds, segments), preload_list(data)


_INHERITED_ONLY = "through inheritance"  # multiprocessing's refusal to pickle Value, Array, Lock, Event...
_CULPRIT_DEPTH = 6  # how deep inside the user's objects the refusing attribute is looked for


def serialize_spec(spec: WorkerSpec, start_method: str) -> tuple[bytes, list[SharedFd]]:
    """The dataset, fn and collate_fn pickled (``dump_spec``) and the descriptors that go
    beside the pickle, or a ``ShippingError`` (a ``TypeError``) naming what refuses and why."""
    try:
        return dump_spec(spec)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises becomes a ShippingError naming it
        raise ShippingError(
            start_method,
            f"{type(exc).__name__}: {exc}",
            culprit=culprit(spec),
            inherited_only=_INHERITED_ONLY in str(exc),
        ) from None  # (the pickler's own traceback, dozens of its frames, says no more: it stays as __context__)


def culprit(spec: WorkerSpec) -> str:
    """The innermost attribute or item of the user's objects that refuses pickling, as an error
    names it (``"an attribute 'conn' holds a socket.socket"``), or "" if none is found."""
    for obj in (spec.source, spec.fn, spec.collate_fn, spec.batch_fn, spec.augment):
        if obj is None or _picklable(obj):
            continue
        found = _refusing(obj, _CULPRIT_DEPTH, set())
        if found is not None:
            name, value = found
            kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
            return f"an {name} holds a {kind}"
    return ""


def _parts_of(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"item {k!r}", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"item {i}", v) for i, v in enumerate(obj)]  # ("an item 3 holds ...")
    try:
        attributes = vars(obj)
    except TypeError:
        return []
    return [(f"attribute {k!r}", v) for k, v in attributes.items()]


def _refusing(obj: Any, depth: int, seen: set[int]) -> tuple[str, Any] | None:
    """The innermost ``(name, value)`` under ``obj`` (which refuses pickling) that refuses too."""
    if depth == 0 or id(obj) in seen:
        return None
    seen.add(id(obj))
    for name, value in _parts_of(obj):
        if isinstance(value, (np.ndarray, str, bytes, int, float)) or _picklable(value):
            continue
        return _refusing(value, depth - 1, seen) or (name, value)
    return None


def _picklable(obj: Any) -> bool:
    try:
        with shipping():  # (procpipe's own shared memory in it travels beside the pickle: not a refusal)
            dump_value(obj)
    except Exception:  # noqa: BLE001 - whatever pickling raises, the answer is no
        return False
    return True


def write_spec(data: bytes, fds: list[SharedFd], segments: Segments) -> ShippedSpec:
    """The pickled spec ``data`` in a sealed segment of shared memory (no worker can change it),
    held until the loader closes, with the descriptors pickled inside it: what a worker receives."""
    fd = segments.new(
        "spec", len(data), "the serialized dataset and functions", "a smaller dataset", data, anonymous=True
    )
    segments.hold(fd)
    seal_writes(fd)
    return ShippedSpec(SharedFd(fd), len(data), fds)
