"""A Loader's source kind: which kind of source it reads, resolved once, and all that follows from it.

``Loader(source, ...)`` accepts four kinds of source, which differ in how an epoch is
ordered, what a task is, how a position is counted and how the cache is laid out:

| source | kind | order (order per epoch) | task (the worker's reader) | samples named (``names``) |
|---|---|---|---|---|
| indexed (``len``, ``[i]``) | ``IndexedKind`` | ``IndexOrder`` | indices (``IndexProducer``) | ``IndexNames`` |
| indexed, ``batches=...`` | ``CallerKind`` | ``CallerOrder`` | indices (``IndexProducer``) | ``IndexNames`` |
| ``Mix`` of indexed datasets | ``MixKind`` | ``MixOrder`` | indices (``IndexProducer``) | ``IndexNames`` |
| ``Shards`` (torch replicas too) | ``StreamKind`` | ``ShardOrder`` | a ``Block`` (the ``Shards``) | ``RecordNames`` |
| ``Mix`` with a stream | ``MixStreamKind`` | ``MixShardOrder`` | a ``Block`` (the ``Shards``) | ``RecordNames`` |

``resolve_kind`` asks "which kind is this?" once, here, and returns a ``SourceKind`` that
answers every later question: the order (its ``batches(epoch)``, ``len``; its
``epoch_plan`` is the per-epoch ``EpochPlan`` the engine builds), the source and the
``reader`` the workers get (_worker/index_producer.py: the producer of a task and the cache's
layout), how messages name its samples (``names``: ``workers=0``'s one driver,
``_consumer/inline.py``, serves every kind), and the saved state (``_sources/saved_state.py``'s
``SourceKind`` protocol): what a state must match (``settings``) and holds beyond the position
(``saved_extras``: a combined state's base, a mixture's weights), whether a state is of this
kind (``check_saved_kind``), a combined state made this rank's own (``elastic_state``, with
``_sources/combine.py``'s ``CombinedLoad``), and the position it resumes (``resume``: a mixture
pins its saved weights first). Each kind answers these with its own methods (``source_kind.py``'s
contract); a new kind is one new class in its package and a line in ``kind_of``. Nothing else in
the package tests a source's type (tests/test_architecture.py counts the places): like Grain's
``RandomAccessDataSource`` beside its iterator datasets, or torchdata's nodes, the rest of the code
holds a protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .indexed.index_kind import CallerKind, IndexedKind
from .mix.mix_kind import MixKind, MixStreamKind
from .mix.mixture import Mix
from .source_kind import SourceKind
from .stream import Shards
from .stream.stream_kind import StreamKind

if TYPE_CHECKING:
    from ..config import Batching, LoaderConfig


def kind_of(source: Any, batching: Batching) -> type[SourceKind]:
    """Which kind ``source`` is: the one place a source's type is tested."""
    if isinstance(source, Shards):
        return StreamKind
    if isinstance(source, Mix):
        return MixStreamKind if source.streaming else MixKind
    return IndexedKind if batching.batches is None else CallerKind


def resolve_kind(source: Any, config: LoaderConfig) -> SourceKind:
    """The kind of ``source`` and its order, from a Loader's configuration (its groups already
    checked, config.py); raises ``TypeError``/``ValueError`` for a source no kind accepts,
    or an option its kind does not support."""
    kind = kind_of(source, config.batching).of(source, config)
    if kind.warns_when_empty and not len(kind.order):
        b = config.batching
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


__all__ = ["kind_of", "resolve_kind", "warn_no_batches"]
