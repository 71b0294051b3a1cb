"""A Loader's source kind: which kind of source it reads, resolved once, and all that follows from it.

``Loader(source, ...)`` accepts four kinds of source, which differ in how an epoch is
ordered, what a task is, how a position is counted and how the cache is laid out:

| source | plan (order per epoch) | task (the worker's reader) | samples named (``names``) |
|---|---|---|---|
| indexed (``len``, ``[i]``) | ``Sampler`` (``ExplicitBatches``) | indices (``IndexedReader``) | ``IndexNames`` |
| ``Mix`` of indexed datasets | ``MixSampler`` | indices (``IndexedReader``) | ``IndexNames`` |
| ``Shards`` (torch replicas too) | ``StreamPlan`` | a ``Block`` (the ``Shards``) | ``RecordNames`` |
| ``Mix`` with a stream | ``MixStreamPlan`` | a ``Block`` (the ``Shards``) | ``RecordNames`` |

``resolve_kind`` asks "which kind is this?" once, here, and returns a ``SourceKind`` that
answers every later question: the plan (its ``batches(epoch)``, ``len``; its
``plan_class`` is the per-epoch ``EpochPlan`` the engine builds), the source and the
``reader`` the workers get (worker/reader.py: the producer of a task and the cache's
layout), how messages name its samples (``names``: ``workers=0``'s one driver,
``api/inline.py``, serves every kind), and what a saved state must match (``settings``,
``mixing``). Nothing else in the package tests a source's type (tests/test_architecture.py
counts the places): like Grain's ``RandomAccessDataSource`` beside its iterator datasets,
or torchdata's nodes, the rest of the code holds a protocol.
"""

from __future__ import annotations

from typing import Any

from ..plan.base import BatchPlan
from ..plan.mix import Mix, MixSampler
from ..plan.sampler import ExplicitBatches, Sampler
from ..streaming import Shards, StreamPlan
from ..worker.reader import IndexedReader, SourceReader
from .inline import IndexNames, RecordNames, SampleNames
from .mixing import MixStreamPlan


class SourceKind:
    """What a Loader knows of its source once its kind is resolved (``resolve_kind``).

    Attributes:
        plan: the epochs' plan (``batches(epoch)``, ``len()``, ``plan_class``): the sampler.
        source: what the workers read (a stream's configured copy of its ``Shards``).
        reader: the worker side (``spec.reader``): how a task is produced, the cache's layout.
        names: how messages name its samples and tasks (``workers=0``'s ``InlineDriver``).
        streaming: a stream (records counted per shard; positions hold a ``StreamProgress``).
        mixing: a ``procpipe.Mix``'s ``MixSampler`` (the weights each epoch used), else None.
    """

    streaming = False
    #: how a message names this kind of source
    described = "an indexable source"

    def __init__(self, plan: BatchPlan, source: Any, reader: SourceReader, names: SampleNames) -> None:
        self.plan = plan
        self.source = source
        self.reader = reader
        self.names = names
        self.mixing: MixSampler | None = None

    def settings(self) -> dict[str, Any]:
        """The plan's settings a saved state must match to be resumed (api/resume.py)."""
        plan: Any = self.plan
        shard = getattr(plan, "shard", None)
        return {
            "length": plan.length,
            "batch_size": getattr(plan, "batch_size", None),
            "shuffle": getattr(plan, "shuffle", False),
            "seed": getattr(plan, "seed", None),
            "drop_last": getattr(plan, "drop_last", False),
            "shard": None if shard is None else list(shard),
            "reshuffle": getattr(plan, "reshuffle", True),
            **({} if self.mixing is None else plan.settings()),
        }


class StreamKind(SourceKind):
    """A stream: ``Shards`` (the torch facade's ``IterableDataset`` replicas are one), or a ``Mix`` holding one."""

    streaming = True
    described = "a streaming source (procpipe.Shards)"

    def __init__(self, plan: StreamPlan) -> None:
        # (the configured Shards reads its own blocks: it is the workers' source and reader both)
        super().__init__(plan, plan.source, plan.source, RecordNames())
        self.mixing = getattr(plan, "mixing", None)  # a MixStreamPlan's

    def settings(self) -> dict[str, Any]:
        return self.plan.settings()  # type: ignore[attr-defined]  # (a StreamPlan)


def resolve_kind(
    source: Any,
    *,
    batch_size: int | None,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    reshuffle: bool,
    shard: tuple[int, int] | None,
    batches: Any,
    shuffle_buffer: int | None,
    **stream_options: Any,
) -> SourceKind:
    """The kind of ``source`` and its plan, from the Loader's arguments (already type-checked by
    ``validate``); raises ``TypeError``/``ValueError`` for a source no kind accepts, or an option
    its kind does not support. ``stream_options``: what only a stream's plan takes
    (``collate_fn``, ``on_error``, ``max_skipped``, ``speculate``, ``batch_fn``, ``cache``, ``even_ranks``)."""
    stream_options.update(
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        reshuffle=reshuffle,
        shard=shard,
        shuffle_buffer=shuffle_buffer,
        batches=batches,
    )
    if isinstance(source, Shards):
        return StreamKind(StreamPlan(source, **stream_options))
    if isinstance(source, Mix) and source.streaming:
        return StreamKind(MixStreamPlan(source, **stream_options))
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise TypeError(
            f"source must support len() and indexing with an int (a list, a numpy array, a torch Dataset...); "
            f"got {type(source).__name__}, which lacks "
            f"{'__len__' if not hasattr(source, '__len__') else '__getitem__'}. Wrap iterables in a list first."
        )
    if shuffle_buffer is not None:
        raise ValueError(
            "shuffle_buffer applies to streaming sources (procpipe.Shards); an indexable "
            "source is shuffled whole with shuffle=True"
        )
    rank = None if shard is None else (shard[0], shard[1])
    options = (len(source), batch_size, bool(shuffle), int(seed), bool(drop_last), rank, bool(reshuffle))
    if isinstance(source, Mix):
        if batches is not None:
            raise ValueError(
                "a procpipe.Mix draws each epoch's order from its weights, but this Loader was also "
                "given batches=..., which would replace it: leave batches= out to mix by weight"
            )
        mixed = MixSampler(*options, mix=source)
        kind = SourceKind(mixed, source, IndexedReader(source), IndexNames())
        kind.mixing = mixed.mixing
    elif batches is not None:
        explicit = ExplicitBatches(batches, len(source), batch_size is None)
        return SourceKind(explicit, source, IndexedReader(source), IndexNames())
    else:
        kind = SourceKind(Sampler(*options), source, IndexedReader(source), IndexNames())
    if not len(kind.plan):
        warn_no_batches(len(source), batch_size, bool(drop_last))
    return kind


def warn_no_batches(length: int, batch_size: int | None, drop_last: bool) -> None:
    """An epoch of this loader would yield nothing: say why (called from ``Loader.__init__``, through
    ``resolve_kind``: the warning names the caller's line)."""
    import warnings

    why = (
        "the source is empty (len(source) == 0)"
        if not length
        else f"drop_last=True drops the only, partial batch ({length} samples < batch_size={batch_size})"
    )
    warnings.warn(f"procpipe.Loader yields no batch: {why}.", stacklevel=4)


__all__ = ["SourceKind", "StreamKind", "resolve_kind"]
