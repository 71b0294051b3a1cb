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
encoder and one decoder (``encode_position``, ``decode_position``), so the format is written once;
an epoch's progress in it is written and read by its kind's ``PositionFormat`` (the ``positions``
of the order's epoch plan: indexed/index_positions.py, stream/stream_positions.py), so this module
tests no kind. ``save_state`` wraps a position with the version and the settings;
``load_state`` checks a saved state against this loader's source kind (source_kind.py: same kind of
source, same data, same settings) and for corruption, and returns the ``Resume`` the next
``iter(loader)`` starts from.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from .._core.checks import is_count
from .._core.reassembly import ResumePoint
from .epoch_plan import PositionFormat

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


def _positions(order: Any) -> PositionFormat:
    """How ``order``'s kind writes an epoch's progress (its epoch plan's ``positions``)."""
    return order.epoch_plan.positions


def encode_position(order: Any, point: ResumePoint) -> dict[str, Any]:
    """``point`` (what was returned, in the form ``Epoch.consumer_progress()`` gives) as a plain dict."""
    epoch, done, ahead, until = point
    positions = _positions(order)
    return {
        EPOCH: epoch,
        **positions.write(done),
        AHEAD: [[n, *positions.write_ahead(p)] for n, p in sorted(ahead.items())],
        UNTIL: until,
    }


def start_position(order: Any, epoch: int, until: int | None) -> dict[str, Any]:
    """The position of an iteration that starts at ``epoch`` and has returned nothing yet."""
    return encode_position(order, ResumePoint(epoch, _positions(order).empty(), {}, until))


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
    positions = _positions(order)
    done = positions.read(order, state, epoch)
    until, ahead = _until_and_ahead(state, epoch, functools.partial(positions.read_ahead, order))
    return Resume(epoch, done, until, ahead)


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
