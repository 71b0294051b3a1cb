"""A Loader's saved state: what ``state_dict`` saves and ``load_state_dict`` takes back.

``save_state`` wraps a position (position.py: the epoch to resume, what the consumer has
had of it and of later epochs, and where the iteration ends; the root node's
``get_state()``) with the format's version and the sampler's settings, as a small
JSON-serializable dict. ``load_state`` checks such a dict against this loader's sampler
(same kind of source, same data, same settings) and for corruption (position.py's
decoder), and returns the ``Resume`` the next ``iter(loader)`` starts from.
"""
from __future__ import annotations

from typing import Any

from . import elastic
from .position import Resume, decode_position
from ..streaming import StreamPlan

_STATE_DEFAULTS = {"reshuffle": True, "even_ranks": False}  # for states saved before the key existed

__all__ = ["Resume", "load_state", "save_state"]


def save_state(sampler: Any, position: dict[str, Any]) -> dict[str, Any]:
    """``Loader.state_dict()``: ``position`` (``position.encode_position``'s dict) with the settings."""
    mix = getattr(sampler, "mix", None)  # a procpipe.Mix source: its weights in this epoch, and its sources
    return {"version": 1, **position, **_sampler_state(sampler), **elastic.saved_base(sampler, position["epoch"]),
            **({} if mix is None else {"mix": mix.state(position["epoch"])})}


def load_state(state: Any, sampler: Any) -> Resume:
    """``Loader.load_state_dict(state)``'s checks: the state, checked against ``sampler``'s settings."""
    if not isinstance(state, dict) or state.get("version") != 1:
        raise ValueError(f"not a procpipe Loader state (from Loader.state_dict(), version 1): {state!r:.200}")
    streaming = isinstance(sampler, StreamPlan)
    if ("stream" in state) != streaming:
        kinds = ("an indexable source", "a streaming source (procpipe.Shards)")
        raise ValueError(f"this state was saved by a loader over {kinds['stream' in state]}, but this loader "
                         f"reads {kinds[streaming]}; resume with a loader built with the same arguments")
    mix = getattr(sampler, "mix", None)
    if mix is not None or "mix" in state:
        if mix is None:
            raise ValueError("this state was saved by a loader over a procpipe.Mix, but this loader's source is not "
                             "one; resume with the same source")
        mix.load(state.get("mix"), state.get("epoch"))  # the saved epoch keeps its weights
    if "combined" in state:  # from procpipe.combine_states (or saved in an epoch resumed from one)
        state = elastic.state_for(state, sampler, streaming)
    else:
        elastic.forget(sampler)
    settings = _sampler_state(sampler)
    for key, mine in settings.items():
        if state.get(key, _STATE_DEFAULTS.get(key)) != mine:
            raise ValueError(
                f"this state was saved by a loader with {key}={state.get(key)!r}, but this loader has "
                f"{key}={mine!r}; resuming needs the same data and settings ({', '.join(settings)})."
            )
    return decode_position(state, sampler)


def _sampler_state(sampler: Any) -> dict[str, Any]:
    """The sampler settings a saved state must match to be resumed."""
    if isinstance(sampler, StreamPlan):
        return sampler.settings()
    shard = getattr(sampler, "shard", None)
    return {"length": sampler.length, "batch_size": getattr(sampler, "batch_size", None),
            "shuffle": getattr(sampler, "shuffle", False), "seed": getattr(sampler, "seed", None),
            "drop_last": getattr(sampler, "drop_last", False), "shard": None if shard is None else list(shard),
            "reshuffle": getattr(sampler, "reshuffle", True)}
