"""The extension API: what procpipe's adapters and tools use of its internals, in one place.

The adapters (``procpipe.torch``, ``procpipe.jax``, ``procpipe.tf``, ``procpipe.keras``,
``procpipe.readers``) and ``procpipe.bench`` are built on the public API (``procpipe``,
``procpipe.config``, ``procpipe.errors``, ``procpipe.loader``) and on this module, and on nothing
else of procpipe's (``tests/test_architecture.py`` checks it). What is here:

- consumer-side nodes: ``Node`` (``next``, ``get_state``, ``reset``), ``Mapped`` (a function over
  each batch, inline) and ``Prefetcher`` (the same, ahead, in a thread);
- ``device=``'s stages: ``DeviceStage`` (what a stage provides) and ``register_device_stage``
  (serve ``Loader(device=...)`` with a stage; the registry is ``_consumer/device_stages.py``);
- the saved state's keys (``EPOCH``, ``DONE``, ...) and position helpers;
- a worker's identity, the per-sample RNG's hooks, collation helpers and the class-by-reference
  picklers, shared-memory descriptors, the ring of a batch's arrays;
- the tensor <-> numpy views (``DTYPE_NAMES``, ``numpy_tensor``, ``tensor_numpy``): they need
  torch, so they are imported when first used (PEP 562). Importing this module imports no
  framework (no torch, TensorFlow, JAX or Keras).

Stability: this is not the public API. A name here may change between minor releases, in the
same change as the adapters that use it; it is the one module to read when it does. Outside
procpipe, use the public API.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._consumer.device_stages import DeviceStage, DeviceStageFactory, register_device_stage
from ._consumer.nodes import Node
from ._consumer.prefetch import Mapped, Prefetcher
from ._core.classref import DillPickler as DillRefPickler
from ._core.classref import Pickler as RefPickler
from ._core.collate import describe_path, find_value, unsendable_error
from ._core.cpus import cpu_budget
from ._core.notes import add_note
from ._core.rings import ring_of
from ._core.rng import device_scope, reseed_current_sample
from ._core.shm import ALIGN, SharedFd, close_fd, new_memory
from ._engine.autotune import schedstat_seconds
from ._engine.policy import CONTENDED
from ._sources.saved_state import (
    AHEAD,
    COMBINED,
    DONE,
    DONE_BELOW,
    EPOCH,
    MIX,
    MIX_WEIGHTS,
    SHARD,
    STREAM,
    UNTIL,
    VERSION,
    VERSION_KEY,
    IndexPosition,
    ended_epoch,
    returned_nothing,
)
from ._sources.stream import Block
from ._worker.identity import worker_index
from ._worker.produce import collate_privately
from ._worker.start_method import spoken_as
from ._worker.worker_spec import WorkerSpec

if TYPE_CHECKING:
    from ._core.tensors import DTYPE_NAMES, numpy_tensor, tensor_numpy

__all__ = [
    "AHEAD",
    "ALIGN",
    "COMBINED",
    "CONTENDED",
    "DONE",
    "DONE_BELOW",
    "DTYPE_NAMES",
    "EPOCH",
    "MIX",
    "MIX_WEIGHTS",
    "SHARD",
    "STREAM",
    "UNTIL",
    "VERSION",
    "VERSION_KEY",
    "Block",
    "DeviceStage",
    "DeviceStageFactory",
    "DillRefPickler",
    "IndexPosition",
    "Mapped",
    "Node",
    "Prefetcher",
    "RefPickler",
    "SharedFd",
    "WorkerSpec",
    "add_note",
    "close_fd",
    "collate_privately",
    "cpu_budget",
    "describe_path",
    "device_scope",
    "ended_epoch",
    "find_value",
    "new_memory",
    "numpy_tensor",
    "register_device_stage",
    "reseed_current_sample",
    "returned_nothing",
    "ring_of",
    "schedstat_seconds",
    "spoken_as",
    "tensor_numpy",
    "unsendable_error",
    "worker_index",
]

#: The names that need torch (``_core/tensors.py`` imports it), imported when first used.
_NEED_TORCH = {"DTYPE_NAMES", "numpy_tensor", "tensor_numpy"}


def __getattr__(name: str) -> object:
    if name not in _NEED_TORCH:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("._core.tensors", __package__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _NEED_TORCH)
