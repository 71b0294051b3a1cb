"""A procpipe batch (numpy) as global ``jax.Array``s, and which part of the data each JAX process loads.

- :func:`default_sharding`: every device of the job on one mesh axis ``"data"``, the batch
  dimension split over it (``NamedSharding(mesh, P("data"))``); in one process, its local devices.
- :func:`shard`: the ``Loader(shard=...)`` of this process for a sharding: the processes that
  hold the same rows of the batch dimension form one data replica and must load the same
  data; the distinct row blocks, in order, are the ranks. With the default sharding that is
  ``(jax.process_index(), jax.process_count())``.
- :class:`Converter`: a batch's numeric numpy arrays (at any depth of dicts, tuples,
  namedtuples and lists) to global arrays in one ``jax.make_array_from_process_local_data``
  call (one ``device_put`` in a single process); everything else (strings, lists of them,
  object or string arrays, 0-d arrays, numbers) left as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

__all__ = ["Converter", "default_sharding", "describe", "shard"]

_NUMERIC_KINDS = frozenset("biufc")  # bool, int, uint, float, complex: what becomes a jax.Array


def default_sharding() -> NamedSharding:
    """Every device of the job on one mesh axis ``"data"``, the batch dimension split over it.

    In one process these are its local devices; with several processes (``jax.distributed``),
    every process's, so that the batch each loads is its part of one global batch.
    """
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    return NamedSharding(mesh, PartitionSpec("data"))


def shard(sharding: Sharding | None = None) -> tuple[int, int] | None:
    """``Loader(shard=...)`` for this process: ``(rank, world_size)``, or None if every process
    loads the whole batch.

    The batch dimension of ``sharding`` (default :func:`default_sharding`) is split into
    blocks of rows; the processes whose devices hold the same block are replicas of one
    another and must load the same samples. The distinct blocks, in order, are the ranks:
    with the default sharding, ``(jax.process_index(), jax.process_count())``; with a
    batch replicated over every process, None.
    """
    sharding = default_sharding() if sharding is None else sharding
    ndim = len(sharding.spec) if isinstance(sharding, NamedSharding) else 1
    rows = jax.device_count()  # divisible by any product of mesh axes
    blocks: dict[int, set[tuple[int, int]]] = {}
    for device, index in sharding.devices_indices_map((rows,) * max(ndim, 1)).items():
        first = index[0]
        start = 0 if first.start is None else first.start
        stop = rows if first.stop is None else first.stop
        blocks.setdefault(device.process_index, set()).add((start, stop))
    held = {process: tuple(sorted(b)) for process, b in blocks.items()}
    distinct = sorted(set(held.values()))
    if len(distinct) == 1:
        return None
    mine = held.get(jax.process_index())
    if mine is None:
        raise ValueError(
            f"procpipe.jax: the sharding {sharding} has no device of this process (process "
            f"{jax.process_index()}), so it loads nothing; use a sharding over every process's devices"
        )
    return distinct.index(mine), len(distinct)


def describe(shard_: tuple[int, int] | None) -> str:
    return "None (every process loads the whole batch)" if shard_ is None else f"{tuple(shard_)}"


def _where(path: tuple[Any, ...]) -> str:
    return "batch" + "".join(f"[{p!r}]" for p in path)


class Converter:
    """A batch to the same structure with its numeric arrays as global ``jax.Array``s.

    Dicts (any ``Mapping``: made a ``dict``), tuples, namedtuples and lists are walked; a
    numpy array of numbers, bools or complex with at least one dimension becomes a global
    array whose first dimension is the batch (this process's rows of it); anything else is
    left as it is. Every array of a batch must have the same first dimension.
    """

    def __init__(self, sharding: Sharding) -> None:
        self.sharding = sharding

    def __call__(self, batch: Any) -> tuple[Any, int | None]:
        """``(converted batch, this process's batch size)`` (size None: the batch has no array)."""
        arrays: list[np.ndarray] = []
        paths: list[tuple[Any, ...]] = []
        skeleton = self._walk(batch, (), arrays, paths)
        if not arrays:
            return batch, None
        size = arrays[0].shape[0]
        if any(a.shape[0] != size for a in arrays):
            sizes = ", ".join(f"{_where(p)}: {a.shape[0]}" for p, a in zip(paths, arrays, strict=True))
            raise ValueError(
                f"procpipe.jax: the arrays of a batch must share their first dimension (the batch), got {sizes}. "
                "Give every field one row per sample (or make the odd field a list, which is left as it is)."
            )
        try:
            placed = jax.make_array_from_process_local_data(self.sharding, arrays)
        except ValueError as exc:
            raise ValueError(
                f"procpipe.jax: the batch (this process's rows: {size}) cannot be laid out over the sharding: "
                f"{exc}. Each process's batch size must be divisible by the number of row blocks "
                "its devices hold (with the default sharding, jax.local_device_count()): use a batch_size that is a "
                "multiple of it, and drop_last=True if the last batch of an epoch is smaller."
            ) from exc
        return _fill(skeleton, iter(placed)), size

    def _walk(self, value: Any, path: tuple[Any, ...], arrays: list[np.ndarray], paths: list[tuple[Any, ...]]) -> Any:
        if isinstance(value, np.ndarray):
            if value.ndim and value.dtype.kind in _NUMERIC_KINDS:
                arrays.append(value)
                paths.append(path)
                return _Slot
            return value
        if isinstance(value, Mapping):
            return {k: self._walk(v, path + (k,), arrays, paths) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            if value and all(isinstance(v, (str, bytes)) for v in value):
                return value  # a batch's strings: left as they are, without walking them
            items = [self._walk(v, path + (i,), arrays, paths) for i, v in enumerate(value)]
            named = hasattr(value, "_fields")
            return _Rebuild(type(value) if named else (list if isinstance(value, list) else tuple), items, named)
        return value


class _Slot:
    """Where a converted array goes back in the batch's skeleton."""


class _Rebuild:
    """A tuple, namedtuple (``named``: its fields as arguments) or list of the skeleton, rebuilt
    once its arrays are placed."""

    __slots__ = ("items", "kind", "named")

    def __init__(self, kind: type, items: list[Any], named: bool) -> None:
        self.kind = kind
        self.items = items
        self.named = named


def _fill(skeleton: Any, placed: Any) -> Any:
    if skeleton is _Slot:
        return next(placed)
    if type(skeleton) is dict:
        return {k: _fill(v, placed) for k, v in skeleton.items()}
    if type(skeleton) is _Rebuild:
        items = [_fill(v, placed) for v in skeleton.items]
        return skeleton.kind(*items) if skeleton.named else skeleton.kind(items)
    return skeleton
