"""A Loader's saved state, in one place: its schema (the keys, typed), the position codec, save and load.

``Loader.state_dict()`` is a small JSON-serializable dict (format ``VERSION``):

==============  ======================================================================================
key             value
==============  ======================================================================================
``version``     ``VERSION`` (1)
``epoch``       the epoch to resume
``done_below``  an indexable source: every batch position below it was returned
``done``        ...and the positions returned beyond that, out of order (sorted)
``stream``      a streaming source instead: None, or the epoch's ``StreamProgress`` state
``ahead``       later epochs of which batches were returned: ``[epoch, done_below, done]`` entries
                (a stream's: ``[epoch, stream]``)
``until``       the epoch the resumed iteration stops before (None: never; absent: the loader's own)
settings        the plan's settings a resume must match (``SourceKind.settings``: ``length``,
                ``batch_size``, ``shuffle``, ``seed``, ``drop_last``, ``shard``, ``reshuffle``, a
                stream's and a mixture's own)
``mix``         a ``procpipe.Mix``: its structure; ``mix_weights``: ``[epoch, weights]`` entries
``combined``    a state made by ``procpipe.combine_states`` (``_sources/combine.py``)
==============  ======================================================================================

The keys are the constants below, and the two shapes of a position the ``TypedDict`` classes
``IndexPosition`` and ``StreamPosition``; the adapters (``procpipe.keras``, ``procpipe.torch``) read a
state through them, not by raw strings.

A *position* is the part that says where a consumer stands: what every consumer-side node
(``procpipe._consumer.nodes``) returns from ``get_state()`` and takes back in ``reset()``. One
encoder and one decoder (``encode_position``, ``decode_position``), so the format is written once.
A order that checks its own progress states (``check_progress``: the ``ShardOrder`` of a
``procpipe.Shards`` source) is a streaming one; this module does not import ``_sources.stream`` (whose
``workers=0`` node uses it). ``save_state`` wraps a position with the version and the settings;
``load_state`` checks a saved state against this loader's source kind (``kinds.py``: same kind of
source, same data, same settings) and for corruption, and returns the ``Resume`` the next
``iter(loader)`` starts from.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from .._core.checks import is_count
from .._core.reassembly import Progress, ResumePoint

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; typing_extensions is read by type checkers only

#: the format's version, saved under ``VERSION_KEY``
VERSION = 1
VERSION_KEY = "version"
EPOCH = "epoch"
DONE_BELOW = "done_below"
DONE = "done"
STREAM = "stream"
AHEAD = "ahead"
UNTIL = "until"
MIX = "mix"
MIX_WEIGHTS = "mix_weights"
COMBINED = "combined"
SHARD = "shard"  # a setting (``SourceKind.settings``), rewritten by a combined state's loading


class IndexPosition(TypedDict):
    """Where a consumer of an indexable source stands (``encode_position``'s dict)."""

    epoch: int
    done_below: int
    done: list[int]
    ahead: list[list[Any]]  # [epoch, done_below, done]
    until: int | None


class StreamPosition(TypedDict):
    """Where a consumer of a streaming source (``procpipe.Shards``) stands."""

    epoch: int
    stream: dict[str, Any] | None  # a StreamProgress state; None: nothing returned of the epoch
    ahead: list[list[Any]]  # [epoch, stream]
    until: int | None


def returned_nothing(state: dict[str, Any]) -> bool:
    """``state`` (a position or a saved state) stands at the start of its epoch: nothing of it or of
    a later epoch was returned yet."""
    return not state.get(DONE_BELOW) and not state.get(DONE) and state.get(STREAM) is None and not state.get(AHEAD)


def ended_epoch(position: dict[str, Any], epoch: int, batches: int) -> IndexPosition:
    """``position`` (an indexable source's) as of the end of ``epoch`` of ``batches`` batches: every
    batch returned, nothing of a later epoch, and the iteration stopping after it."""
    return {**position, EPOCH: epoch, DONE_BELOW: batches, DONE: [], AHEAD: [], UNTIL: epoch + 1}  # type: ignore[typeddict-item]


def other_source_kind(saved: str, reads: str) -> ValueError:
    """The error of a state saved by a loader over ``saved`` (a kind of source, described) loaded
    by one that reads ``reads``."""
    return ValueError(
        f"this state was saved by a loader over {saved}, but this loader "
        f"reads {reads}; resume with a loader built with the same arguments"
    )


def other_mixture_kind(saved_mix: bool) -> ValueError:
    """The error of a state saved by a loader over a ``procpipe.Mix`` (``saved_mix``) or not, loaded
    by one that reads the other."""
    kinds = ("an indexable source", "a procpipe.Mix")
    return ValueError(
        f"this state was saved by a loader over {kinds[saved_mix]}, but this loader reads "
        f"{kinds[not saved_mix]}; resume with a loader built with the same arguments (mix=...)"
    )


STATE_DEFAULTS = {"reshuffle": True, "even_ranks": False}  # for states saved before the key existed

LOADER_EPOCHS = "loader"  # a state without "until": the next iteration spans the loader's own ``epochs``


class Resume(tuple):
    """A decoded position: ``done`` and ``ahead``'s values are frozensets of batch positions, or
    for a streaming source ``StreamProgress`` states (or None); ``until`` an int, None (endless)
    or ``LOADER_EPOCHS`` (not saved: the loader's own ``epochs``)."""

    def __new__(cls, epoch: int, done: Any, until: Any, ahead: dict[int, Any]) -> Self:
        return super().__new__(cls, (epoch, done, until, ahead))

    epoch = property(lambda self: self[0])
    done = property(lambda self: self[1])
    until = property(lambda self: self[2])  # int, None (endless) or LOADER_EPOCHS
    ahead = property(lambda self: self[3])

    def until_or(self, default: int | None) -> int | None:
        """The epoch the resumed iteration stops before: the saved one, else ``default``
        (the loader's own ``epochs`` from the resumed epoch on)."""
        return default if self.until is LOADER_EPOCHS else self.until


def is_streaming(order: Any) -> bool:
    """``order`` plans a streaming source (its epochs' progress is a ``StreamProgress`` state)."""
    return callable(getattr(order, "check_progress", None))


def encode_position(order: Any, point: ResumePoint) -> dict[str, Any]:
    """``point`` (what was returned, in the form ``Epoch.consumer_progress()`` gives) as a plain dict."""
    epoch, done, ahead, until = point
    if is_streaming(order):
        progress = {STREAM: done, AHEAD: [[n, p] for n, p in sorted(ahead.items())]}
    else:
        done = _as_progress(done)
        ahead = {n: _as_progress(p) for n, p in ahead.items()}
        progress = {
            DONE_BELOW: done.below,
            DONE: sorted(done.beyond),
            AHEAD: [[n, p.below, sorted(p.beyond)] for n, p in sorted(ahead.items())],
        }
    return {EPOCH: epoch, **progress, UNTIL: until}


def _as_progress(done: Any) -> Progress:
    """Positions returned, as a ``Progress`` (a decoded position holds frozensets)."""
    return done if isinstance(done, Progress) else Progress(done or ())


def start_position(order: Any, epoch: int, until: int | None) -> dict[str, Any]:
    """The position of an iteration that starts at ``epoch`` and has returned nothing yet."""
    empty = None if is_streaming(order) else Progress()
    return encode_position(order, ResumePoint(epoch, empty, {}, until))


def decode_position(state: Any, order: Any) -> Resume:
    """A position (``encode_position``'s dict, or a whole saved state), checked against ``order``;
    raises ``ValueError`` naming what is corrupt."""
    if not isinstance(state, dict):
        # (a corrupt saved state is a ValueError whatever is wrong with it: callers catch ValueError)
        raise ValueError(  # noqa: TRY004 - a corrupt state, see above
            f"not a procpipe position (a dict from get_state() or Loader.state_dict()): {state!r:.200}"
        )
    epoch = state.get(EPOCH)
    if not is_count(epoch, 0):
        raise ValueError(f"corrupt procpipe Loader state: epoch={epoch!r}")
    if is_streaming(order):
        done = order.check_progress(state.get(STREAM), epoch)
        until, ahead = _until_and_ahead(state, epoch, functools.partial(_stream_ahead_entry, order))
    else:

        def progress(number: int, rest: list) -> frozenset:
            return _index_progress(_batch_count(order, number), number, rest)

        done = progress(epoch, [state.get(DONE_BELOW), state.get(DONE)])
        until, ahead = _until_and_ahead(state, epoch, progress)
    return Resume(epoch, done, until, ahead)


def _batch_count(order: Any, epoch: int) -> int | None:
    """Batches in ``epoch``, if the order knows (a ``batches=`` callable without ``__len__`` does not;
    an ``IndexOrder`` resumed from ``procpipe.combine_states`` has its own count for the resumed epoch)."""
    per_epoch = getattr(order, "epoch_batches", None)
    try:
        return per_epoch(epoch) if per_epoch is not None else len(order)
    except TypeError:
        return None


def _until_and_ahead(
    state: dict[str, Any], epoch: int, progress: Callable[[int, list], Any]
) -> tuple[Any, dict[int, Any]]:
    """``until`` and ``ahead`` of a saved state, checked (both optional: older states lack them).

    ``ahead`` entries are ``[epoch, ...]``; ``progress(epoch, rest)`` checks and converts the rest.
    """
    until = state.get(UNTIL, LOADER_EPOCHS)
    if until is not LOADER_EPOCHS and until is not None and not is_count(until, epoch + 1):
        raise ValueError(f"corrupt procpipe Loader state: until={until!r} with epoch={epoch!r}")
    ahead: dict[int, Any] = {}
    raw = state.get(AHEAD, [])
    if not isinstance(raw, list):
        raise ValueError(f"corrupt procpipe Loader state: ahead={raw!r:.200}")  # noqa: TRY004 - a corrupt state
    for entry in raw:
        n = entry[0] if isinstance(entry, list) and entry else None
        if not is_count(n, epoch + 1) or n in ahead or (isinstance(until, int) and n >= until):
            raise ValueError(f"corrupt procpipe Loader state: ahead entry {entry!r:.200}")
        ahead[n] = progress(n, entry[1:])
    return until, ahead


def _index_progress(count: int | None, epoch: int, rest: list) -> frozenset:
    """``[done_below, done]`` of an indexable source's epoch, checked: the positions returned.

    ``count``: batches per epoch (None: unknown); a position past it is refused before any
    set is built (``done_below=10**10`` would otherwise exhaust memory).
    """
    ok = len(rest) == 2
    if ok:
        below, beyond = rest
        ok = is_count(below, 0) and isinstance(beyond, list) and all(is_count(x, below + 1) for x in beyond)
    if not ok:
        raise ValueError(f"corrupt procpipe Loader state: done_below, done = {rest!r:.200} for epoch {epoch}")
    if count is not None and (below > count or (beyond and max(beyond) >= count)):
        raise ValueError(
            f"procpipe Loader state out of range: done_below, done = {rest!r:.200} for epoch {epoch}, "
            f"but an epoch of this loader has {count} batches (positions 0 to {count - 1}); "
            "the state is corrupt or from another loader"
        )
    return frozenset(itertools.chain(range(below), beyond))


def _stream_ahead_entry(order: Any, epoch: int, rest: list) -> dict:
    """``[stream]`` of an ``ahead`` entry of a streaming source's state, checked."""
    if len(rest) != 1 or rest[0] is None:
        raise ValueError(f"corrupt procpipe Loader state: ahead entry for epoch {epoch}: {rest!r:.200}")
    return order.check_progress(rest[0], epoch)
