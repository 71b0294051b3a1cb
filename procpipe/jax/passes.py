"""``procpipe.jax.iterator``: passes over a loader, each batch as global ``jax.Array``s, copied ahead.

Each ``iter()`` of a :class:`GlobalBatches` is one ``loader.iterate(stage)`` (one epoch, or the
loader's ``epochs=N``), with ``stage`` the prefetching thread of ``procpipe._ext``
(``Prefetcher``): it takes the loader's numpy batches ahead of the training loop and makes the
global arrays there (:class:`procpipe.jax.arrays.Converter`: ``make_array_from_process_local_data``,
whose copies to the devices run while the step runs), keeping with each batch the loader's
position once it had given it. The loader's root node is that thread, so ``loader.state_dict()``
counts the batches the loop took, not those the thread holds.

In a job of several JAX processes every process runs the same loop, so the consumer's thread
checks, at the first batch of a pass and at each batch whose size differs from the last one
checked (the last, smaller batch of an epoch), that every process has the same number of rows:
one small ``process_allgather``, twice an epoch, instead of a global array of inconsistent
shapes (whose step would fail or hang in a collective).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from .._ext import Mapped, Node, Prefetcher
from .arrays import Converter, default_sharding, describe, shard

__all__ = ["GlobalBatches", "iterator"]


def iterator(loader: Any, sharding: Sharding | None = None, prefetch: int = 2) -> GlobalBatches:
    """``loader``'s batches with their arrays as global ``jax.Array``s, copied to the devices ahead.

    Args:
        loader: a ``procpipe.Loader`` (numpy batches: no ``device=``). In a job of several
            JAX processes, built with ``shard=procpipe.jax.shard(sharding)`` (with the
            default sharding ``(jax.process_index(), jax.process_count())``): each process
            loads its rows of every global batch.
        sharding: how each array is laid out over the devices, its first dimension the
            batch; default :func:`procpipe.jax.default_sharding` (every device on one axis
            ``"data"``).
        prefetch: batches made ahead of the training loop, their copies in flight while
            the step runs (a thread makes them); ``0``: made in ``next()``, no thread.

    Returns:
        A :class:`GlobalBatches`: each ``for batch in it`` is one pass, one iteration of the
        loader (one epoch by default); ``len()`` is the loader's.

    Raises:
        ValueError: ``prefetch`` is not an int >= 0; the loader has a ``device=`` (torch
            tensors, not numpy); or, with several processes, the loader's ``shard`` is not
            the one the sharding asks of this process (the message names both).
    """
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"procpipe.jax.iterator: prefetch must be an int >= 0, got {prefetch!r}")
    if sharding is None:
        sharding = default_sharding()
    elif not isinstance(sharding, Sharding):
        raise TypeError(
            f"procpipe.jax.iterator: sharding must be a jax.sharding.Sharding (e.g. NamedSharding(mesh, "
            f"PartitionSpec('data'))), got {type(sharding).__name__}"
        )
    device = getattr(getattr(getattr(loader, "config", None), "device", None), "device", None)
    if device is not None:
        raise ValueError(
            f"procpipe.jax.iterator: the loader was built with device={device!r}, so its batches are torch "
            "tensors; procpipe.jax makes jax.Arrays from numpy batches: build the loader without device="
        )
    _check_shard(loader, sharding)
    return GlobalBatches(loader, sharding, prefetch)


def _check_shard(loader: Any, sharding: Sharding) -> None:
    """With several processes: the loader loads this process's part of every global batch."""
    if jax.process_count() == 1:
        return
    config = getattr(loader, "config", None)
    batching = getattr(config, "batching", None)
    if batching is None:
        return  # not a procpipe.Loader: the caller's loader shards as it will
    have = batching.shard
    want = shard(sharding)
    if (None if have is None or tuple(have) == (0, 1) else tuple(have)) != want:
        raise ValueError(
            f"procpipe.jax.iterator: this is process {jax.process_index()} of {jax.process_count()}, and the "
            f"sharding asks it for part {describe(want)} of every batch, but the loader was built with "
            f"shard={describe(None if have is None else tuple(have))}. Build it with "
            f"procpipe.Loader(..., shard=procpipe.jax.shard(sharding)) (here shard={want!r}), so that each process "
            "loads its own rows of the global batch."
        )


class GlobalBatches:
    """Passes over a loader, each batch's arrays as global ``jax.Array``s (:func:`iterator`).

    Each ``iter()`` starts one iteration of the loader (ending an unfinished one, as
    ``iter(loader)`` does). ``loader.state_dict()`` counts the batches this pass returned,
    not those made ahead; ``loader.load_state_dict()`` then the next pass resumes there.
    """

    def __init__(self, loader: Any, sharding: Sharding, prefetch: int) -> None:
        self.loader = loader
        self.sharding = sharding
        self.prefetch = prefetch
        self._convert = Converter(sharding)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        check = _SizeCheck() if jax.process_count() > 1 else None
        transfer = _transfer(self._convert, check)
        prefetch = self.prefetch

        def stage(node: Node) -> Node:
            if prefetch == 0:
                return Mapped(node, lambda batch: _ready(*transfer(batch)))
            return Prefetcher(node, transfer, depth=prefetch)

        iterate = getattr(self.loader, "iterate", None)
        if iterate is not None:
            return iterate(stage)  # type: ignore[no-any-return]
        return stage(_Plain(iter(self.loader)))  # type: ignore[arg-type]  # any iterable of numpy batches


def _ready(batch: Any, ready: Callable[[], None] | None) -> Any:
    if ready is not None:
        ready()
    return batch


def _transfer(convert: Converter, check: _SizeCheck | None) -> Callable[[Any], tuple[Any, Callable[[], None] | None]]:
    """``Prefetcher``'s function: a batch -> (its global arrays, the consumer-side size check or None)."""

    def transfer(batch: Any) -> tuple[Any, Callable[[], None] | None]:
        placed, size = convert(batch)
        if check is None or size is None:
            return placed, None
        return placed, lambda: check(size)  # decided in the consumer's thread, batch by batch, as every process

    return transfer


class _SizeCheck:
    """Every process has the same number of rows in this batch: checked in the consumer's thread
    (every process calls it at the same batch of the same loop), when the size changes."""

    def __init__(self) -> None:
        self.agreed: int | None = None

    def __call__(self, size: int) -> None:
        if size == self.agreed:
            return
        from jax.experimental import multihost_utils

        sizes = np.asarray(multihost_utils.process_allgather(np.asarray([size], np.int64))).reshape(-1)
        if len(set(sizes.tolist())) > 1:
            listed = ", ".join(f"process {i}: {n}" for i, n in enumerate(sizes.tolist()))
            raise ValueError(
                f"procpipe.jax: the processes' batches differ in size ({listed}), so they make no global batch. "
                "Give every process's Loader the same batch_size and shard=procpipe.jax.shard() (an indexed "
                "source's ranks then have equal batches); a Shards source needs even_ranks=True, and "
                "on_error='skip' can leave one process's batch short: use drop_last=True or on_error='raise'."
            )
        self.agreed = size


class _Plain(Iterator[Any]):
    """Any iterator as a source without state (``iterator()`` over something other than a Loader):
    no ``get_state``, so the stage keeps none."""

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it

    def __next__(self) -> Any:
        return next(self._it)
