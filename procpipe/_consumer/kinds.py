"""A Loader's source kind: which kind of source it reads, resolved once, and all that follows from it.

``Loader(source, ...)`` accepts four kinds of source, which differ in how an epoch is
ordered, what a task is, how a position is counted and how the cache is laid out:

| source | kind | plan (order per epoch) | task (the worker's reader) | samples named (``names``) |
|---|---|---|---|---|
| indexed (``len``, ``[i]``) | ``IndexedKind`` | ``Sampler`` | indices (``IndexedReader``) | ``IndexNames`` |
| indexed, ``batches=...`` | ``ExplicitKind`` | ``ExplicitBatches`` | indices (``IndexedReader``) | ``IndexNames`` |
| ``Mix`` of indexed datasets | ``MixKind`` | ``MixSampler`` | indices (``IndexedReader``) | ``IndexNames`` |
| ``Shards`` (torch replicas too) | ``StreamKind`` | ``StreamPlan`` | a ``Block`` (the ``Shards``) | ``RecordNames`` |
| ``Mix`` with a stream | ``MixStreamKind`` | ``MixStreamPlan`` | a ``Block`` (the ``Shards``) | ``RecordNames`` |

``resolve_kind`` asks "which kind is this?" once, here, and returns a ``SourceKind`` that
answers every later question: the plan (its ``batches(epoch)``, ``len``; its
``plan_class`` is the per-epoch ``EpochPlan`` the engine builds), the source and the
``reader`` the workers get (_worker/reader.py: the producer of a task and the cache's
layout), how messages name its samples (``names``: ``workers=0``'s one driver,
``_consumer/inline.py``, serves every kind), and the saved state (``_consumer/state.py``'s
``SourceKind`` protocol): what a state must match (``settings``) and holds beyond the position
(``saved_extras``: a combined state's base, a mixture's weights), whether a state is of this
kind (``check_saved_kind``), a combined state made this rank's own (``elastic_state``, with
``_consumer/elastic.py``'s ``CombinedLoad``), and the position it resumes (``resume``: a mixture
pins its saved weights first). Each kind answers these with its own methods; a new kind is one
new class here. Nothing else in the package tests a source's type (tests/test_architecture.py
counts the places): like Grain's ``RandomAccessDataSource`` beside its iterator datasets,
or torchdata's nodes, the rest of the code holds a protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .._mix import elastic as elastic_mix
from .._mix.mix import Mix, MixSampler
from .._mix.mixing import MixStreamPlan
from .._plan.base import BatchPlan
from .._plan.sampler import ExplicitBatches, GivenOrders, Sampler
from .._streaming import Shards, StreamPlan
from .._worker.reader import IndexedReader
from .._worker.worker_spec import Producer
from . import elastic
from .inline import IndexNames, RecordNames, SampleNames
from .state import AHEAD, EPOCH, MIX, SHARD, STREAM, Resume, decode_position, other_mixture_kind, other_source_kind

if TYPE_CHECKING:
    from ..config import LoaderConfig


class SourceKind:
    """What a Loader knows of its source once its kind is resolved (``resolve_kind``), and what
    each kind answers for itself: the saved state's settings and extras, whether a saved state is
    of this kind, a combined state (``procpipe.combine_states``) made this loader's own, and the
    position a state resumes. ``_consumer/state.py`` asks these methods (its ``SourceKind``
    protocol), so a new kind is one new class here, not a flag tested in the state's code.

    This base class is an indexed source whose epochs are not drawn from settings it can redraw:
    ``IndexedKind`` (a ``Sampler``), ``ExplicitKind`` (``batches=...``) and ``MixKind`` refine it.

    Attributes:
        plan: the epochs' plan (``batches(epoch)``, ``len()``, ``plan_class``): the sampler.
        source: what the workers read (a stream's configured copy of its ``Shards``).
        reader: the worker side (``spec.producer``): how a task is produced, the cache's layout.
        names: how messages name its samples and tasks (``workers=0``'s ``InlineDriver``).
    """

    #: how a message names this kind of source
    described = "an indexable source"

    def __init__(self, plan: BatchPlan, source: Any, reader: Producer, names: SampleNames) -> None:
        self.plan = plan
        self.source = source
        self.reader = reader
        self.names = names

    # ---- saving (_consumer/state.py save_state)
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
            SHARD: None if shard is None else list(shard),
            "reshuffle": getattr(plan, "reshuffle", True),
        }

    def saved_extras(self, position: dict[str, Any]) -> dict[str, Any]:
        """What a state saved at ``position`` holds beyond the position and the settings."""
        return {}

    # ---- loading (_consumer/state.py load_state)
    def check_saved_kind(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``state`` was saved by a loader over another kind of source:
        first its positions (records of a stream, or batch positions), then a mixture or not."""
        self.check_positions_kind(state)
        self.check_mixture_kind(state)

    def check_positions_kind(self, state: dict[str, Any]) -> None:
        if STREAM in state:
            raise other_source_kind("a streaming source (procpipe.Shards)", self.described)

    def check_mixture_kind(self, state: dict[str, Any]) -> None:
        if MIX in state:
            raise other_mixture_kind(saved_mix=True)

    def elastic_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A state holding ``combined`` (``procpipe.combine_states``) made into this loader's own
        (``_consumer/elastic.py``); the result is checked as usual."""
        raise NotImplementedError

    def forget_combined(self) -> None:
        """A state not combined is loaded: drop the order an earlier combined state gave."""

    def resume(self, state: dict[str, Any]) -> Resume:
        """The position ``state`` (checked: kind, settings) resumes."""
        return decode_position(state, self.plan)


class ExplicitKind(SourceKind):
    """An indexed source read in the caller's order (``batches=...``, ``ExplicitBatches``): a
    combined state cannot split it anew."""

    def elastic_state(self, state: dict[str, Any]) -> dict[str, Any]:
        elastic.CombinedLoad(state, self.plan)  # (this rank's shard checked first, as for every kind)
        raise ValueError(
            "a combined state (procpipe.combine_states) resumes a loader whose batches come from its "
            "own sampler; this loader's come from batches=..., which cannot be split anew"
        )


class IndexedKind(SourceKind):
    """An indexed source (``len``, ``[i]``) with a ``Sampler``: a combined state gives it the order
    of the epoch it resumes (``given``: ``GivenOrders``)."""

    def __init__(self, plan: Sampler | MixSampler, source: Any) -> None:
        super().__init__(plan, source, IndexedReader(source), IndexNames())
        self.given: GivenOrders = plan.given

    def saved_extras(self, position: dict[str, Any]) -> dict[str, Any]:
        return elastic.saved_base(self.given, position[EPOCH])

    def order_settings(self) -> dict[str, Any]:
        """The settings an epoch's order is drawn from (a combined state's must be the same)."""
        plan: Any = self.plan
        keys = ("shuffle", "seed", "reshuffle", "length", "batch_size", "drop_last")
        return {key: getattr(plan, key) for key in keys}

    def epoch_order(self, load: elastic.CombinedLoad) -> np.ndarray:
        """The resumed epoch's order before sharding."""
        return load.full_order()

    def elastic_state(self, state: dict[str, Any]) -> dict[str, Any]:
        load = elastic.CombinedLoad(state, self.plan)
        if load.same_settings(self.order_settings()):
            load.give(self.epoch_order(load), self.given)
        return load.out

    def forget_combined(self) -> None:
        self.given.forget()


class Mixing:
    """What a ``procpipe.Mix`` adds to its kind (``MixKind``, ``MixStreamKind``): the weights each
    epoch used, saved with a state (``mix_weights``) and pinned when one is loaded (``mixing``: its
    ``MixSampler``)."""

    mixing: MixSampler

    def saved_extras(self, position: dict[str, Any]) -> dict[str, Any]:
        epochs = [position[EPOCH], *(entry[0] for entry in position.get(AHEAD, []))]
        return {**super().saved_extras(position), **self.mixing.save_weights(epochs)}  # type: ignore[misc]

    def check_mixture_kind(self, state: dict[str, Any]) -> None:
        if MIX not in state:
            raise other_mixture_kind(saved_mix=False)

    def order_settings(self) -> dict[str, Any]:
        return {**super().order_settings(), MIX: self.mixing.settings()[MIX]}  # type: ignore[misc]

    def resume(self, state: dict[str, Any]) -> Resume:
        # The epochs begun are planned again with the weights they had (pinned first: a stream's
        # progress is checked against its epoch's order).
        previous = self.mixing.pin(state)
        try:
            resume = super().resume(state)  # type: ignore[misc]
            self.mixing.check_pinned([resume.epoch, *resume.ahead])
        except BaseException:
            self.mixing.unpin(previous)
            raise
        return resume


class MixKind(Mixing, IndexedKind):
    """A ``procpipe.Mix`` of indexed sources (a ``MixSampler``): its order is drawn again from the
    weights a combined state saved (``_mix/elastic.py``)."""

    def __init__(self, plan: MixSampler, source: Any) -> None:
        super().__init__(plan, source)
        self.mixing = plan.mixing

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), **self.mixing.settings()}

    def epoch_order(self, load: elastic.CombinedLoad) -> np.ndarray:
        return elastic_mix.saved_order(self.mixing, load.state, load.epoch)


class StreamKind(SourceKind):
    """A stream: ``Shards`` (the torch facade's ``IterableDataset`` replicas are one)."""

    described = "a streaming source (procpipe.Shards)"

    def __init__(self, plan: StreamPlan) -> None:
        # (the configured Shards reads its own blocks: it is the workers' source and reader both)
        super().__init__(plan, plan.source, plan.source, RecordNames())

    def settings(self) -> dict[str, Any]:
        return self.plan.settings()  # type: ignore[attr-defined]  # (a StreamPlan)

    def check_positions_kind(self, state: dict[str, Any]) -> None:
        if STREAM not in state:
            raise other_source_kind("an indexable source", self.described)

    def order_settings(self) -> dict[str, Any]:
        """The settings an epoch's order of shards is drawn from."""
        mine = self.settings()
        return {key: mine[key] for key in ("shuffle", "seed", "reshuffle", "shards", "cycle_length", "block_length")}

    def elastic_state(self, state: dict[str, Any]) -> dict[str, Any]:
        load = elastic.CombinedLoad(state, self.plan)
        load.keep_progress(state.get(STREAM), set(self.plan.batches(load.epoch)))
        return load.out


class MixStreamKind(Mixing, StreamKind):
    """A ``procpipe.Mix`` holding a stream (``MixStreamPlan``): its shards' order is drawn again
    from the weights a combined state saved, and the ranks' progress merged against it."""

    def __init__(self, plan: MixStreamPlan) -> None:
        super().__init__(plan)
        self.mixing = plan.mixing

    def elastic_state(self, state: dict[str, Any]) -> dict[str, Any]:
        load = elastic.CombinedLoad(state, self.plan)
        if not load.same_settings(self.order_settings()):
            return load.out  # (the usual checks name the setting that differs)
        full = elastic_mix.saved_order(self.mixing, state, load.epoch).tolist()
        load.keep_progress(load.ranks_progress(full), set(full[load.rank :: load.world]))
        return load.out


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
        return MixStreamKind(MixStreamPlan(source, **plan_options(config)))
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
    kind: SourceKind
    if isinstance(source, Mix):
        if b.batches is not None:
            raise ValueError(
                "a procpipe.Mix draws each epoch's order from its weights, but this Loader was also "
                "given batches=..., which would replace it: leave batches= out to mix by weight"
            )
        kind = MixKind(MixSampler(*options, mix=source), source)
    elif b.batches is not None:
        explicit = ExplicitBatches(b.batches, len(source), b.batch_size is None)
        return ExplicitKind(explicit, source, IndexedReader(source), IndexNames())
    else:
        kind = IndexedKind(Sampler(*options), source)
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


__all__ = [
    "ExplicitKind",
    "IndexedKind",
    "MixKind",
    "MixStreamKind",
    "SourceKind",
    "StreamKind",
    "plan_options",
    "resolve_kind",
]
