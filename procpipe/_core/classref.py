"""Pickling the user's classes by reference, so a batch comes back as instances of the very
class the user defined, never of a look-alike.

What a worker sends back (a batch's layout, a ``collate_fn``'s result) can hold classes
that pickle cannot find by ``module.__qualname__``:

- a class made by a factory inside another class: ``class Outer: Row = namedtuple("Row", ...)``
  gives ``Row.__qualname__ == "Row"``, but ``Row`` lives at ``Outer.Row``;
- a class the worker received *by value*: the loader ships the classes of ``__main__``
  that way (cloudpickle: _worker/spec_shipping.py ``dump_spec``), and a worker started by the
  zygote, a forkserver or spawn does not import the main script (start_method.py), so its
  ``__main__`` has no such class at all.

pickle then fails and dill pickles the class by value, so the consumer rebuilds a new
class with the same name: ``isinstance(batch, Outer.Row)`` is False. ``reduce_class``
names such a class by where it is found in its module (by identity, else a unique class
of the same name and module), so the receiving process, which has the original module,
gets its own class object. A ``__main__`` class the worker cannot find goes as its name
plus a by-value copy (``main_class``): the receiver, whose ``__main__`` is the script,
looks it up there (nested classes too) and uses the copy only if it has none. Classes
defined inside a function still travel by value.

Where it sits: used by ``wire.send`` (worker replies) and ``procpipe.torch`` (the packed
result of a ``collate_fn``), on the worker side of the data path.
"""

from __future__ import annotations

import importlib
import io
import pickle
import sys
import weakref
from typing import Any

import cloudpickle
import dill

_MAX_DEPTH = 3  # how deep inside module-level classes a class is looked for
_located: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> its reduction, or None


def find(module: str, path: str) -> Any:
    """The object at ``path`` (dotted attributes) in ``module``, importing it if needed."""
    obj: Any = sys.modules.get(module) or importlib.import_module(module)
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _by_qualname(cls: type) -> Any:
    try:
        return find(cls.__module__, cls.__qualname__)
    except Exception:  # noqa: BLE001 - not importable, or not there
        return None


_MAIN_NAMES = {"__main__", "__mp_main__"}  # (the main script imported again by a user's own spawned process)


def _same_module(a: str, b: str) -> bool:
    return a == b or (a in _MAIN_NAMES and b in _MAIN_NAMES)


def _search_in(module: Any, name: str, module_name: str, cls: type | None = None) -> str:
    """Where class ``cls`` is in ``module`` (its module-level classes and those nested in
    them): by identity, else the one class called ``name`` of ``module_name``; "" if nowhere."""
    same_name: list[str] = []
    seen: set[int] = set()
    frontier = [(key, value) for key, value in list(vars(module).items()) if isinstance(value, type)]
    for _ in range(_MAX_DEPTH):
        nested = []
        for path, value in frontier:
            if id(value) in seen:
                continue
            seen.add(id(value))
            if cls is not None and value is cls:
                return path
            if value.__name__ == name and _same_module(value.__module__, module_name):
                same_name.append(path)
            for key, inner in list(vars(value).items()):
                if isinstance(inner, type):
                    nested.append((f"{path}.{key}", inner))
        frontier = nested
    return same_name[0] if len(same_name) == 1 else ""


def _search(cls: type) -> str:
    """Where ``cls`` is in its module: by identity, else the one class of the same name; "" if nowhere."""
    module = sys.modules.get(cls.__module__)
    return "" if module is None else _search_in(module, cls.__name__, cls.__module__, cls)


def main_class(qualname: str, name: str, copy: bytes) -> Any:
    """In the process that unpickles: the class of *its* ``__main__`` that a worker named
    (at ``qualname``, else the one class called ``name`` there, nested ones included), else
    the worker's copy (``copy``: the class pickled by value, ``_by_value``)."""
    try:
        found = find("__main__", qualname)
    except Exception:  # noqa: BLE001 - not there
        found = None
    if isinstance(found, type) and found.__name__ == name:
        return found
    main = sys.modules.get("__main__")
    path = "" if main is None else _search_in(main, name, "__main__")
    return find("__main__", path) if path else pickle.loads(copy)


def _by_value(cls: type) -> bytes:
    """Class ``cls`` pickled by value: by cloudpickle (a ``__main__`` class with ``Generic`` bases
    and the script's ``TypeVar``s, an enum), else by dill."""
    try:
        return cloudpickle.dumps(cls, pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - whatever cloudpickle refuses, dill tries
        return dill.dumps(cls, pickle.HIGHEST_PROTOCOL)


def _locate(obj: type, found: Any) -> tuple | None:
    """The reduction of class ``obj``, which its ``__qualname__`` does not find (``found``)."""
    if isinstance(found, type) and found.__name__ == obj.__name__:
        return (find, (obj.__module__, obj.__qualname__))  # a by-value copy of a class its module defines
    path = _search(obj)
    if path:
        return (find, (obj.__module__, path))
    if obj.__module__ in _MAIN_NAMES and "<locals>" not in obj.__qualname__:
        # A worker started by forkserver or spawn does not import the main script
        # (start_method.py): dill sent it the script's classes by value, and its own __main__
        # has none of them. Name the class for the receiver's __main__, which is the script.
        return (main_class, (obj.__qualname__, obj.__name__, _by_value(obj)))
    return None


def reduce_class(obj: Any) -> tuple | None:
    """A pickle reduction naming class ``obj`` by reference, or None: pickle it as usual
    (it is found by its ``__qualname__``, or it is not a class, or it cannot be found)."""
    if not isinstance(obj, type):
        return None
    found = _by_qualname(obj)
    if found is obj:
        return None
    try:
        if obj in _located:
            return _located[obj]
    except TypeError:  # not weak-referenceable
        return None
    reduction = _locate(obj, found)
    _located[obj] = reduction
    return reduction


_IN_MEMORY = (io.BytesIO, io.StringIO)  # file objects that pickle whole (their contents)


def is_open_file(obj: Any) -> bool:
    """Whether ``obj`` is a file object over an OS file or stream (not an in-memory one)."""
    return isinstance(obj, io.IOBase) and not isinstance(obj, _IN_MEMORY)


class DillPickler(dill.Pickler):
    """dill, but classes ``reduce_class`` can name go by reference, and an open file is refused.

    dill pickles a file object by its name: the receiver opens the file again, a new handle at
    position 0 (or fails, on a pipe or socket), silently not the object the worker made. What
    a worker sends back must be the value it made, so such a value is an error
    (``collate.unsendable_error`` words it, naming the field)."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if is_open_file(obj):
            raise pickle.PicklingError(
                f"procpipe does not pickle an open file ({obj!r}): another process would get a new "
                "handle, at position 0, not this one"
            )
        if isinstance(obj, type) and id(obj) not in self.memo:
            reduction = reduce_class(obj)
            if reduction is not None:
                self.save_reduce(*reduction, obj=obj)
                return
        super().save(obj, save_persistent_id)


class Pickler(pickle.Pickler):
    """The C pickler, but classes ``reduce_class`` can name go by reference."""

    def reducer_override(self, obj: Any) -> Any:
        reduction = reduce_class(obj)
        return NotImplemented if reduction is None else reduction


def dumps(obj: Any, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    """``obj`` pickled: by the C pickler when it can, else by dill; classes by reference where found."""
    buffer = io.BytesIO()
    try:
        Pickler(buffer, protocol).dump(obj)
    except Exception:  # noqa: BLE001 - lambdas, local classes...: dill
        buffer = io.BytesIO()
        DillPickler(buffer, protocol).dump(obj)
    return buffer.getvalue()
