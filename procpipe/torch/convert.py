"""Numpy batches as torch tensors, and ``device_fn`` on them: ``Loader(device="cpu")`` (needs ``torch``).

``to_torch`` turns every numeric/bool numpy array of a batch (numpy views of a ring slot)
into a tensor sharing its memory: no copy, no thread. ``cpu_stage`` is the whole
``device="cpu"`` stage: a ``Mapped`` node (procpipe/_consumer/prefetch.py) running ``to_torch``,
then ``device_fn`` if one is given, in the consumer's thread. ``apply_device_fn`` runs
``device_fn`` with ``batch_rng()`` seeded from ``(seed, epoch, batch position)``, here and on
a GPU (procpipe/torch/cuda_transfer.py), so a batch draws the same numbers on either.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .._ext import Mapped, Node, add_note, device_scope

__all__ = ["apply_device_fn", "cpu_stage", "to_torch"]


def to_torch(batch: Any) -> Any:
    """Every numpy array (numeric or bool) of ``batch`` as a tensor sharing its memory.

    Containers (dict, list, tuple, namedtuple) keep their type; other leaves (strings,
    objects, arrays of str) are left as they are. This is ``Loader(device="cpu")``. A
    read-only array (one that arrived through Ray's object store, procpipe.ray) is copied:
    a tensor cannot be read-only, and writing into the store's memory would corrupt it.
    """
    kind = type(batch)
    if kind is np.ndarray:
        if batch.dtype.kind not in "biufc":
            return batch
        return torch.from_numpy(batch if batch.flags.writeable else batch.copy())
    if kind is dict:
        return {k: to_torch(v) for k, v in batch.items()}
    if kind is list:
        return [to_torch(v) for v in batch]
    if kind is tuple:
        return tuple(to_torch(v) for v in batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return kind(*(to_torch(v) for v in batch))
    return batch


def apply_device_fn(device_fn: Callable[[Any], Any], seed: int, position: tuple[int, int], batch: Any) -> Any:
    """``device_fn(batch)`` with ``batch_rng()`` seeded by ``(seed, *position)`` (``position``:
    ``(epoch, seq)`` of the batch); an exception it raises gets a note naming the batch."""
    epoch, seq = position
    try:
        with device_scope(seed, epoch, seq):
            return device_fn(batch)
    except Exception as exc:
        add_note(exc, f"procpipe: raised by device_fn on batch {seq} of epoch {epoch}.")
        raise


def position_of(it: Any, count: Iterator[int]) -> tuple[int, int]:
    """``(epoch, seq)`` of the batch ``it`` returned last; where the iterator does not say (a
    streaming source with ``workers=0``), ``(0, how many batches came before)`` (``count``
    counts the calls)."""
    seq = next(count)
    return getattr(it, "position", None) or (0, seq)


def cpu_stage(it: Node, device_fn: Callable[[Any], Any] | None, seed: int) -> Mapped:
    """``Loader(device="cpu")``'s stage over the epoch iterator ``it``: tensors sharing the ring's
    memory, then ``device_fn`` (in the consumer's thread, seeded as on a GPU)."""
    if device_fn is None:
        return Mapped(it, to_torch)
    count = itertools.count()
    return Mapped(it, lambda b: apply_device_fn(device_fn, seed, position_of(it, count), to_torch(b)))
