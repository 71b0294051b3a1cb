"""The contract every source kind answers (``SourceKind``): what a Loader knows of its source
once its kind is resolved (``resolve.py``), and the questions each kind answers for itself.

A kind is an order (``order``: ``batches(epoch)``, ``len``, the ``epoch_plan`` of its epochs), the
workers' side (``producer``: how a task is produced, the cache's layout), how messages name its
samples (``names``) and the saved state's answers: its ``settings``, what it saves beyond the
position, whether a state is of this kind, a combined state made its own and the position a state
resumes. The kinds, each in its package: ``indexed/index_kind.py`` (``IndexedKind``,
``CallerKind``), ``stream/stream_kind.py`` (``StreamKind``), ``mix/mix_kind.py`` (``MixKind``,
``MixStreamKind``). Like Grain's random-access and streaming datasets under one state protocol, or
torchdata's nodes, the rest of the code holds this protocol and never tests a source's type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from .._worker.worker_spec import Producer
from .epoch_plan import Order
from .sample_names import SampleNames
from .saved_state import (
    COMBINED,
    MIX,
    SHARD,
    STATE_DEFAULTS,
    STREAM,
    VERSION,
    VERSION_KEY,
    Resume,
    decode_position,
    other_mixture_kind,
    other_source_kind,
)

if TYPE_CHECKING:
    from ..config import LoaderConfig


class SourceKind:
    """What a Loader knows of its source once its kind is resolved (``resolve_kind``), and what
    each kind answers for itself: the saved state's settings and extras, whether a saved state is
    of this kind, a combined state (``procpipe.combine_states``) made this loader's own, and the
    position a state resumes. ``save_state`` and ``load_state`` below ask these methods, so a new
    kind is one new class in its package, not a flag tested in the state's code.

    This base class is an indexed source whose epochs are not drawn from settings it can redraw:
    ``IndexedKind`` (an ``IndexOrder``), ``CallerKind`` (``batches=...``) and ``MixKind`` refine it.

    Attributes:
        order: the loader's order (``batches(epoch)``, ``len()``, the ``epoch_plan`` each epoch is run by).
        source: the source the workers' spec names (``WorkerSpec.source``): the user's, or a
            mixture of streams' combined ``Shards``.
        producer: the worker side (``spec.producer``): how a task is produced, the cache's layout.
        names: how messages name its samples and tasks (``workers=0``'s ``InlineDriver``).
    """

    #: how a message names this kind of source
    described: ClassVar[str] = "an indexable source"
    #: whether an epoch with no batch is worth a warning when the loader is made (an indexed
    #: source with the loader's own order: its length is known, and nothing else may fill it)
    warns_when_empty: ClassVar[bool] = False

    @classmethod
    def of(cls, source: Any, config: LoaderConfig) -> SourceKind:
        """This kind for ``source``, its order built from the loader's configuration groups
        (the batching group and, for a stream, the stages and faults groups)."""
        raise NotImplementedError

    def __init__(self, order: Order, source: Any, producer: Producer, names: SampleNames) -> None:
        self.order = order
        self.source = source
        self.producer = producer
        self.names = names

    # ---- saving (save_state, below)
    def settings(self) -> dict[str, Any]:
        """The order's settings a saved state must match to be resumed (_sources/saved_state.py)."""
        order: Any = self.order
        shard = getattr(order, "shard", None)
        return {
            "length": order.length,
            "batch_size": getattr(order, "batch_size", None),
            "shuffle": getattr(order, "shuffle", False),
            "seed": getattr(order, "seed", None),
            "drop_last": getattr(order, "drop_last", False),
            SHARD: None if shard is None else list(shard),
            "reshuffle": getattr(order, "reshuffle", True),
        }

    def saved_extras(self, position: dict[str, Any]) -> dict[str, Any]:
        """What a state saved at ``position`` holds beyond the position and the settings."""
        return {}

    # ---- loading (load_state, below)
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
        (``_sources/combine.py``); the result is checked as usual."""
        raise NotImplementedError

    def forget_combined(self) -> None:
        """A state not combined is loaded: drop the order an earlier combined state gave."""

    def resume(self, state: dict[str, Any]) -> Resume:
        """The position ``state`` (checked: kind, settings) resumes."""
        return decode_position(state, self.order)


def save_state(kind: SourceKind, position: dict[str, Any]) -> dict[str, Any]:
    """``Loader.state_dict()``: ``position`` (``encode_position``'s dict) with the settings and what
    the kind adds (``saved_extras``: for a ``procpipe.Mix``, the weights of the epochs the position
    names, ``mix_weights``)."""
    return {VERSION_KEY: VERSION, **position, **kind.settings(), **kind.saved_extras(position)}


def load_state(state: Any, kind: SourceKind) -> Resume:
    """``Loader.load_state_dict(state)``'s checks: the state, checked against ``kind`` (the kind of
    source it was saved over, and the settings of its order)."""
    if not isinstance(state, dict) or state.get(VERSION_KEY) != VERSION:
        raise ValueError(f"not a procpipe Loader state (from Loader.state_dict(), version 1): {state!r:.200}")
    kind.check_saved_kind(state)
    if COMBINED in state:  # from procpipe.combine_states (or saved in an epoch resumed from one)
        state = kind.elastic_state(state)
    else:
        kind.forget_combined()
    settings = kind.settings()
    for key, mine in settings.items():
        if state.get(key, STATE_DEFAULTS.get(key)) != mine:
            raise ValueError(
                f"this state was saved by a loader with {key}={state.get(key)!r}, but this loader has "
                f"{key}={mine!r}; resuming needs the same data and settings ({', '.join(settings)})."
            )
    return kind.resume(state)


__all__ = ["SourceKind", "load_state", "save_state"]
