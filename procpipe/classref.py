"""Pickling the user's classes by reference, so a batch comes back as instances of the very
class the user defined, never of a look-alike.

What a worker sends back (a batch's layout, a ``collate_fn``'s result) can hold classes
that pickle cannot find by ``module.__qualname__``:

- a class made by a factory inside another class: ``class Outer: Row = namedtuple("Row", ...)``
  gives ``Row.__qualname__ == "Row"``, but ``Row`` lives at ``Outer.Row``;
- a class the worker received *by value* (dill ships classes of ``__main__`` that way):
  the worker's module defines its own twin, which is not the same object.

pickle then fails and dill pickles the class by value, so the consumer rebuilds a new
class with the same name: ``isinstance(batch, Outer.Row)`` is False. ``reduce_class``
names such a class by where it is found in its module (by identity, else a unique class
of the same name and module), so the receiving process, which has the original module,
gets its own class object. Classes that cannot be found at all (defined inside a
function) still travel by value.

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

import dill

_MAX_DEPTH = 3  # how deep inside module-level classes a class is looked for
_located: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> path, or "" (none)


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


_MAIN_NAMES = {"__main__", "__mp_main__"}  # a worker imports the main script again as __mp_main__


def _same_module(a: str, b: str) -> bool:
    return a == b or (a in _MAIN_NAMES and b in _MAIN_NAMES)


def _search(cls: type) -> str:
    """Where ``cls`` is in its module: by identity, else the one class of the same name; "" if nowhere."""
    module = sys.modules.get(cls.__module__)
    if module is None:
        return ""
    same_name: list[str] = []
    seen: set[int] = set()
    frontier = [(name, value) for name, value in list(vars(module).items()) if isinstance(value, type)]
    for _ in range(_MAX_DEPTH):
        nested = []
        for path, value in frontier:
            if id(value) in seen:
                continue
            seen.add(id(value))
            if value is cls:
                return path
            if value.__name__ == cls.__name__ and _same_module(value.__module__, cls.__module__):
                same_name.append(path)
            for name, inner in list(vars(value).items()):
                if isinstance(inner, type):
                    nested.append((f"{path}.{name}", inner))
        frontier = nested
    return same_name[0] if len(same_name) == 1 else ""


def reduce_class(obj: Any) -> tuple | None:
    """A pickle reduction naming class ``obj`` by reference, or None: pickle it as usual
    (it is found by its ``__qualname__``, or it is not a class, or it cannot be found)."""
    if not isinstance(obj, type):
        return None
    found = _by_qualname(obj)
    if found is obj:
        return None
    try:
        path = _located.get(obj)
    except TypeError:
        return None
    if path is None:
        if isinstance(found, type) and found.__name__ == obj.__name__:
            path = obj.__qualname__  # the worker's by-value copy of a class its module defines
        else:
            path = _search(obj)
        try:
            _located[obj] = path
        except TypeError:
            pass
    return (find, (obj.__module__, path)) if path else None


class DillPickler(dill.Pickler):
    """dill, but classes ``reduce_class`` can name go by reference."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
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
