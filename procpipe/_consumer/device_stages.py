"""The stages ``Loader(device=...)`` can use, by name: a registry, so the core never imports an adapter.

A stage is made by a factory, ``factory(device, prefetch, device_fn, seed) -> DeviceStage``, checked
before any worker starts. The Loader asks for the stage named ``"torch"`` (``DEFAULT``: today the
only one); ``device_stage_factory(name)`` finds it:

1. a factory registered in this process (``register_device_stage(name, factory)``): the torch
   adapter's ``device`` module registers its own when it is imported;
2. else the entry point ``name`` of the group ``procpipe.device_stages`` (``ENTRY_POINT_GROUP``),
   loaded the first time it is needed (procpipe's own pyproject declares the torch one, so
   ``device=`` works without importing the adapter first; an adapter outside procpipe declares
   its own the same way);
3. else a ``RuntimeError`` that says how to get one.

``import procpipe`` never imports torch: the entry point is read, and the adapter imported, only
by the first Loader given ``device=``. Adapters reach this module through ``procpipe._ext``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from importlib import metadata
from typing import Any, Protocol

from .nodes import Node

__all__ = [
    "DEFAULT",
    "ENTRY_POINT_GROUP",
    "DeviceStage",
    "DeviceStageFactory",
    "device_stage_factory",
    "register_device_stage",
]

DEFAULT = "torch"  # the stage a Loader's device= uses
ENTRY_POINT_GROUP = "procpipe.device_stages"


class DeviceStage(Protocol):
    """What the Loader needs of ``device=``'s stage (the torch adapter's: ``torch/device.py``)."""

    slots_held: int  # ring slots the stage may hold while it copies from them

    def __call__(self, it: Node) -> Node:
        """Wrap one iteration's source node: batches as the device's tensors."""
        ...

    def info(self) -> dict[str, int]:
        """``Loader.stats()["device"]``."""
        ...

    def close(self) -> None:
        """Release what the stage holds (``Loader.close``)."""
        ...


class DeviceStageFactory(Protocol):
    """``factory(device, prefetch, device_fn, seed)``: ``device=``'s stage, ``device`` checked (a
    ``ValueError`` or ``RuntimeError`` for one it cannot serve)."""

    def __call__(
        self, device: Any, prefetch: int, device_fn: Callable[[Any], Any] | None, seed: int
    ) -> DeviceStage: ...


_factories: dict[str, DeviceStageFactory] = {}
_lock = threading.Lock()


def register_device_stage(name: str, factory: DeviceStageFactory | None) -> DeviceStageFactory | None:
    """Serve ``device=`` stages named ``name`` with ``factory`` (None: forget ``name``'s). Returns
    the factory registered before, if any, so that a caller (a test) can put it back."""
    with _lock:
        before = _factories.pop(name, None)
        if factory is not None:
            _factories[name] = factory
        return before


def device_stage_factory(name: str = DEFAULT) -> DeviceStageFactory:
    """The factory of the stage named ``name``: the registered one, else its entry point's."""
    with _lock:
        found = _factories.get(name)
    if found is not None:
        return found
    points = [p for p in metadata.entry_points(group=ENTRY_POINT_GROUP) if p.name == name]
    if points:
        loaded: DeviceStageFactory = points[0].load()  # imports the adapter, which may register itself
        with _lock:
            return _factories.setdefault(name, loaded)
    raise RuntimeError(
        f"device= needs the {name!r} device stage, and none is registered: install procpipe with its "
        f"{name} extra (pip install 'procpipe[{name}]'), or import the adapter before making the Loader "
        f"(import procpipe.{name}). An editable install made before procpipe declared its device stages "
        f"lacks their entry points (group {ENTRY_POINT_GROUP!r}): run pip install -e . again."
    )
