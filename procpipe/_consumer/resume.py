"""A Loader's saved state: what ``state_dict`` saves and ``load_state_dict`` takes back.

``save_state`` wraps a position (position.py: the epoch to resume, what the consumer has
had of it and of later epochs, and where the iteration ends; the root node's
``get_state()``) with the format's version and the sampler's settings, as a small
JSON-serializable dict. ``load_state`` checks such a dict against this loader's source kind
(kinds.py: same kind of source, same data, same settings of its plan) and for corruption (position.py's
decoder), and returns the ``Resume`` the next ``iter(loader)`` starts from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import elastic
from .position import Resume, decode_position

if TYPE_CHECKING:
    from .kinds import SourceKind

_STATE_DEFAULTS = {"reshuffle": True, "even_ranks": False}  # for states saved before the key existed

__all__ = ["Resume", "load_state", "save_state"]


def save_state(kind: SourceKind, position: dict[str, Any]) -> dict[str, Any]:
    """``Loader.state_dict()``: ``position`` (``position.encode_position``'s dict) with the settings
    (and, for a ``procpipe.Mix``, the weights of the epochs the position names: ``mix_weights``)."""
    state = {"version": 1, **position, **kind.settings(), **elastic.saved_base(kind.given, position["epoch"])}
    if kind.mixing is not None:
        state.update(kind.mixing.save_weights([position["epoch"], *(entry[0] for entry in position.get("ahead", []))]))
    return state


def load_state(state: Any, kind: SourceKind) -> Resume:
    """``Loader.load_state_dict(state)``'s checks: the state, checked against the settings of ``kind``'s plan."""
    if not isinstance(state, dict) or state.get("version") != 1:
        raise ValueError(f"not a procpipe Loader state (from Loader.state_dict(), version 1): {state!r:.200}")
    sampler, streaming, mixing = kind.plan, kind.streaming, kind.mixing
    if ("stream" in state) != streaming:
        kinds = ("an indexable source", "a streaming source (procpipe.Shards)")
        raise ValueError(
            f"this state was saved by a loader over {kinds['stream' in state]}, but this loader "
            f"reads {kind.described}; resume with a loader built with the same arguments"
        )
    if ("mix" in state) != (mixing is not None):
        kinds = ("an indexable source", "a procpipe.Mix")
        raise ValueError(
            f"this state was saved by a loader over {kinds['mix' in state]}, but this loader reads "
            f"{kinds['mix' not in state]}; resume with a loader built with the same arguments (mix=...)"
        )
    if "combined" in state:  # from procpipe.combine_states (or saved in an epoch resumed from one)
        state = elastic.state_for(state, sampler, streaming, mixing, kind.given)
    elif kind.given is not None:
        kind.given.forget()
    settings = kind.settings()
    for key, mine in settings.items():
        if state.get(key, _STATE_DEFAULTS.get(key)) != mine:
            raise ValueError(
                f"this state was saved by a loader with {key}={state.get(key)!r}, but this loader has "
                f"{key}={mine!r}; resuming needs the same data and settings ({', '.join(settings)})."
            )
    if mixing is None:
        return decode_position(state, sampler)
    # A Mix: the epochs begun are planned again with the weights they had (pinned first: a stream's
    # progress is checked against its epoch's order).
    previous = mixing.pin(state)
    try:
        resume = decode_position(state, sampler)
        mixing.check_pinned([resume.epoch, *resume.ahead])
    except BaseException:
        mixing.unpin(previous)
        raise
    return resume
