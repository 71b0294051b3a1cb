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
``reader`` the workers get (_worker/reader.py: the producer of a task and the cache's
layout), how messages name its samples (``names``: ``workers=0``'s one driver,
``_consumer/inline.py``, serves every kind), and what a saved state must match (``settings``,
``mixing``). Nothing else in the package tests a source's type (tests/test_architecture.py
counts the places): like Grain's ``RandomAccessDataSource`` beside its iterator datasets,
or torchdata's nodes, the rest of the code holds a protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._mix.mix import Mix, MixSampler
from .._mix.mixing import MixStreamPlan
from .._plan.base import BatchPlan
from .._plan.sampler import ExplicitBatches, GivenOrders, Sampler
from .._streaming import Shards, StreamPlan
from .._worker.reader import IndexedReader, SourceReader
from .inline import IndexNames, RecordNames, SampleNames

if TYPE_CHECKING:
    from ..config import LoaderConfig


class SourceKind:
    """What a Loader knows of its source once its kind is resolved (``resolve_kind``).

    Attributes:
        plan: the epochs' plan (``batches(epoch)``, ``len()``, ``plan_class``): the sampler.
        source: what the workers read (a stream's configured copy of its ``Shards``).
        reader: the worker side (``spec.reader``): how a task is produced, the cache's layout.
        names: how messages name its samples and tasks (``workers=0``'s ``InlineDriver``).
        streaming: a stream (records counted per shard; positions hold a ``StreamProgress``).
        mixing: a ``procpipe.Mix``'s ``MixSampler`` (the weights each epoch used), else None.
        given: where a combined state (``procpipe.combine_states``) installs the order of the
            epoch it resumes (``GivenOrders``): an indexed source's or a ``Mix``'s plan; None
            for ``batches=...`` (the caller's order cannot be split anew) and for streams (their
            progress is per shard).
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
        self.given: GivenOrders | None = None

    def settings(self) -> dict[str, Any]:
        """The plan's settings a saved state must match to be resumed (_consumer/state.py)."""
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


def plan_options(config: LoaderConfig) -> dict[str, Any]:
    """What a plan is built from, read from the configuration's groups (``loader.config``): the
    batching group's order settings, and what only a stream's plan takes (``collate_fn``,
    ``batch_fn``, ``cache`` from the stages; ``on_error``, ``max_skipped``, ``speculate`` from the
    faults; ``even_ranks``)."""
    batching, stages, faults = config.batching, config.stages, config.faults
    return {
        "batch_size": batching.batch_size,
        "shuffle": batching.shuffle,
        "seed": batching.seed,
        "drop_last": batching.drop_last,
        "reshuffle": batching.reshuffle,
        "shard": batching.shard,
        "shuffle_buffer": batching.shuffle_buffer,
        "batches": batching.batches,
        "even_ranks": batching.even_ranks,
        "collate_fn": stages.collate_fn,
        "batch_fn": stages.batch_fn,
        "cache": stages.cache,
        "on_error": faults.on_error,
        "max_skipped": faults.max_skipped,
        "speculate": faults.speculate,
    }


def resolve_kind(source: Any, config: LoaderConfig) -> SourceKind:
    """The kind of ``source`` and its plan, from a Loader's configuration (its groups already
    checked, config.py); raises ``TypeError``/``ValueError`` for a source no kind accepts,
    or an option its kind does not support."""
    if isinstance(source, Shards):
        return StreamKind(StreamPlan(source, **plan_options(config)))
    if isinstance(source, Mix) and source.streaming:
        return StreamKind(MixStreamPlan(source, **plan_options(config)))
    b = config.batching
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise TypeError(
            f"source must support len() and indexing with an int (a list, a numpy array, a torch Dataset...); "
            f"got {type(source).__name__}, which lacks "
            f"{'__len__' if not hasattr(source, '__len__') else '__getitem__'}. Wrap iterables in a list first."
        )
    if b.shuffle_buffer is not None:
        raise ValueError(
            "shuffle_buffer applies to streaming sources (procpipe.Shards); an indexable "
            "source is shuffled whole with shuffle=True"
        )
    rank = None if b.shard is None else (b.shard[0], b.shard[1])
    options = (len(source), b.batch_size, bool(b.shuffle), int(b.seed), bool(b.drop_last), rank, bool(b.reshuffle))
    if isinstance(source, Mix):
        if b.batches is not None:
            raise ValueError(
                "a procpipe.Mix draws each epoch's order from its weights, but this Loader was also "
                "given batches=..., which would replace it: leave batches= out to mix by weight"
            )
        mixed = MixSampler(*options, mix=source)
        kind = SourceKind(mixed, source, IndexedReader(source), IndexNames())
        kind.mixing, kind.given = mixed.mixing, mixed.given
    elif b.batches is not None:
        explicit = ExplicitBatches(b.batches, len(source), b.batch_size is None)
        return SourceKind(explicit, source, IndexedReader(source), IndexNames())
    else:
        sampler = Sampler(*options)
        kind = SourceKind(sampler, source, IndexedReader(source), IndexNames())
        kind.given = sampler.given
    if not len(kind.plan):
        warn_no_batches(len(source), b.batch_size, bool(b.drop_last))
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


__all__ = ["SourceKind", "StreamKind", "plan_options", "resolve_kind"]
