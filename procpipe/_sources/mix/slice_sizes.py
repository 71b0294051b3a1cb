"""Indexed sources in a mixture of streams: how many *virtual shards* each one is read as.

Why: a ``procpipe.Mix`` of streams (``procpipe.Shards``) mixes **shards**, drawn by weight,
then read in the stream's interleave. An indexed dataset (``len`` + ``__getitem__``) given
beside streams is therefore read as a stream too: its epoch order (a permutation from
``(seed, epoch)`` with ``shuffle=True``, else ``0, 1, ...``) cut into contiguous slices of
``shard_size`` elements, each slice one shard of the mixture (``_sources/mix/index_slices.py`` reads
them). Its weight is then per shard, as every stream's: so that a weight means the same for
every source, a slice is by default as large as the streams' mean shard (from their
``lengths=``); without those record counts the size cannot be known, and ``shard_size=``
must say it.

This module holds only the arithmetic (pure: the plan layer); the mixture (``_sources/mix/mixture.py``)
asks it how long each source is in its index space.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..._core.checks import check_int

__all__ = ["indexed_shard_size", "virtual_shards"]


def virtual_shards(elements: int, shard_size: int) -> int:
    """The number of shards of ``shard_size`` elements (the last one shorter) ``elements`` make."""
    return -(-elements // shard_size)


def indexed_shard_size(
    sources: Sequence[Any], shard_size: Any, is_stream: Callable[[Any], bool], leaves: Callable[[Any], list[Any]]
) -> int | None:
    """The slice size of the indexed sources of a mixture whose ``sources`` hold streams (None
    when no indexed source is among them, or no stream: nothing is sliced).

    ``shard_size``: the user's (an int >= 1), or None: the mean records per shard of every
    stream among ``sources`` (nested mixtures' streams included: ``leaves``), rounded, which
    needs their ``lengths=``. Raises naming the fix when it cannot be known, or when
    ``shard_size`` is given where nothing is sliced."""
    streams = [is_stream(source) for source in sources]
    sliced = any(streams) and not all(streams)
    if shard_size is not None:
        check_int("shard_size", shard_size, 1, owner="Mix: ")
        if not sliced:
            raise ValueError(
                "Mix: shard_size applies to an indexed dataset mixed with streams (procpipe.Shards), read as "
                "shards of shard_size elements; this mixture's sources are all "
                f"{'streams' if all(streams) else 'indexed'}: leave shard_size out"
            )
        return int(shard_size)
    if not sliced:
        return None
    records = shards = 0
    for source, stream in zip(sources, streams, strict=True):
        if not stream:
            continue
        for leaf in leaves(source):
            lengths = getattr(leaf, "lengths", None)
            if not is_stream(leaf):
                continue  # (a nested mixture's indexed source: sized by that mixture)
            if lengths is None:
                k = streams.index(False)
                raise ValueError(
                    f"Mix: sources[{k}] is an indexed dataset mixed with streams, so it is read as shards "
                    "like theirs; their size is by default the streams' mean records per shard, but a stream "
                    "of this mixture has no Shards(lengths=...): pass Mix(..., shard_size=N), N about the "
                    "records of one of the streams' shards (a mixture of streams draws shards by weight)"
                )
            records += sum(lengths)
            shards += len(lengths)
    if not shards or not records:
        raise ValueError(
            "Mix: an indexed dataset mixed with streams is read as shards of the streams' mean size, but "
            "the streams of this mixture have no records; pass Mix(..., shard_size=N)"
        )
    return max(1, round(records / shards))
