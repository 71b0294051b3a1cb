"""A Loader's saved position: what ``state_dict`` saves and ``load_state_dict`` takes back.

``save_state`` writes where an iteration stands (``Loader._position``: the epoch to
resume, what the consumer has had of it and of later epochs, and where the iteration
ends) as a small JSON-serializable dict, with the sampler's settings. ``load_state``
checks such a dict against this loader's sampler (same data, same settings) and for
corruption, and returns a ``Resume``: what the next ``iter(loader)`` starts from. What
an indexable source's epoch has had is a set of batch positions (``Progress``,
reassembly.py); a streaming source's is a ``StreamProgress`` state (streaming/order.py),
checked by its ``StreamPlan``.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

from .checks import is_count
from .streaming import StreamPlan

_STATE_DEFAULTS = {"reshuffle": True}  # for states saved before the key existed
_LOADER_EPOCHS = "loader"  # a state without "until": the next iteration spans the loader's own ``epochs``


class Resume(tuple):
    """What ``load_state_dict`` left for the next ``iter()``: ``done`` and ``ahead``'s values are
    frozensets of batch positions, or for a streaming source ``StreamProgress`` states (or None)."""

    def __new__(cls, epoch: int, done: Any, until: Any, ahead: dict[int, Any]) -> Resume:
        return super().__new__(cls, (epoch, done, until, ahead))

    epoch = property(lambda self: self[0])
    done = property(lambda self: self[1])
    until = property(lambda self: self[2])  # int, None (endless) or _LOADER_EPOCHS
    ahead = property(lambda self: self[3])

    def until_or(self, default: int | None) -> int | None:
        """The epoch the resumed iteration stops before: the saved one, else ``default``
        (the loader's own ``epochs`` from the resumed epoch on)."""
        return default if self.until is _LOADER_EPOCHS else self.until


def save_state(sampler: Any, epoch: int, done: Any, ahead: dict[int, Any], until: int | None) -> dict[str, Any]:
    """``Loader.state_dict()``: the position ``(epoch, done, ahead, until)`` (``Loader._position``)."""
    if isinstance(sampler, StreamPlan):
        progress = {"stream": done, "ahead": [[n, p] for n, p in sorted(ahead.items())]}
    else:
        progress = {"done_below": done.below, "done": sorted(done.beyond),
                    "ahead": [[n, p.below, sorted(p.beyond)] for n, p in sorted(ahead.items())]}
    return {"version": 1, "epoch": epoch, **progress, "until": until, **_sampler_state(sampler)}


def load_state(state: Any, sampler: Any) -> Resume:
    """``Loader.load_state_dict(state)``'s checks: the state, checked against ``sampler``'s settings."""
    if not isinstance(state, dict) or state.get("version") != 1:
        raise ValueError(f"not a procpipe Loader state (from Loader.state_dict(), version 1): {state!r:.200}")
    streaming = isinstance(sampler, StreamPlan)
    if ("stream" in state) != streaming:
        kinds = ("an indexable source", "a streaming source (procpipe.Shards)")
        raise ValueError(f"this state was saved by a loader over {kinds['stream' in state]}, but this loader "
                         f"reads {kinds[streaming]}; resume with a loader built with the same arguments")
    settings = _sampler_state(sampler)
    for key, mine in settings.items():
        if state.get(key, _STATE_DEFAULTS.get(key)) != mine:
            raise ValueError(
                f"this state was saved by a loader with {key}={state.get(key)!r}, but this loader has "
                f"{key}={mine!r}; resuming needs the same data and settings ({', '.join(settings)})."
            )
    epoch = state.get("epoch")
    if not is_count(epoch, 0):
        raise ValueError(f"corrupt procpipe Loader state: epoch={epoch!r}")
    if streaming:
        done = sampler.check_progress(state.get("stream"), epoch)
        until, ahead = _until_and_ahead(state, epoch, functools.partial(_stream_ahead_entry, sampler))
    else:
        progress = functools.partial(_index_progress, _batch_count(sampler))
        done = progress(epoch, [state.get("done_below"), state.get("done")])
        until, ahead = _until_and_ahead(state, epoch, progress)
    return Resume(epoch, done, until, ahead)


def _batch_count(sampler: Any) -> int | None:
    """Batches per epoch, if the sampler knows (a ``batches=`` callable without ``__len__`` does not)."""
    try:
        return len(sampler)
    except TypeError:
        return None


def _sampler_state(sampler: Any) -> dict[str, Any]:
    """The sampler settings a saved state must match to be resumed."""
    if isinstance(sampler, StreamPlan):
        return sampler.settings()
    shard = getattr(sampler, "shard", None)
    return {"length": sampler.length, "batch_size": getattr(sampler, "batch_size", None),
            "shuffle": getattr(sampler, "shuffle", False), "seed": getattr(sampler, "seed", None),
            "drop_last": getattr(sampler, "drop_last", False), "shard": None if shard is None else list(shard),
            "reshuffle": getattr(sampler, "reshuffle", True)}


def _until_and_ahead(state: dict[str, Any], epoch: int,
                     progress: Callable[[int, list], Any]) -> tuple[Any, dict[int, Any]]:
    """``until`` and ``ahead`` of a saved state, checked (both optional: older states lack them).

    ``ahead`` entries are ``[epoch, ...]``; ``progress(epoch, rest)`` checks and converts the rest.
    """
    until = state.get("until", _LOADER_EPOCHS)
    if until is not _LOADER_EPOCHS and until is not None and not is_count(until, epoch + 1):
        raise ValueError(f"corrupt procpipe Loader state: until={until!r} with epoch={epoch!r}")
    ahead: dict[int, Any] = {}
    raw = state.get("ahead", [])
    if not isinstance(raw, list):
        raise ValueError(f"corrupt procpipe Loader state: ahead={raw!r:.200}")
    for entry in raw:
        n = entry[0] if isinstance(entry, list) and entry else None
        if (not is_count(n, epoch + 1) or n in ahead
                or (isinstance(until, int) and n >= until)):
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
        ok = (is_count(below, 0) and isinstance(beyond, list)
              and all(is_count(x, below + 1) for x in beyond))
    if not ok:
        raise ValueError(f"corrupt procpipe Loader state: done_below, done = {rest!r:.200} for epoch {epoch}")
    if count is not None and (below > count or (beyond and max(beyond) >= count)):
        raise ValueError(f"procpipe Loader state out of range: done_below, done = {rest!r:.200} for epoch {epoch}, "
                         f"but an epoch of this loader has {count} batches (positions 0 to {count - 1}); "
                         "the state is corrupt or from another loader")
    return frozenset(itertools.chain(range(below), beyond))


def _stream_ahead_entry(sampler: StreamPlan, epoch: int, rest: list) -> dict:
    """``[stream]`` of an ``ahead`` entry of a streaming source's state, checked."""
    if len(rest) != 1 or rest[0] is None:
        raise ValueError(f"corrupt procpipe Loader state: ahead entry for epoch {epoch}: {rest!r:.200}")
    return sampler.check_progress(rest[0], epoch)
