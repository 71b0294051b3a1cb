"""``procpipe.Mix``: a weighted mixture of indexed sources, like tf.data's ``sample_from_datasets``.

Where it sits: a ``Mix`` is an indexed source (``len`` and ``[i]``: index ``i`` is record
``i - offset[k]`` of source ``k``), so workers read it like any dataset. What makes it a
mixture is the order of each epoch, which the ``Sampler`` takes from ``Mix.epoch_order``
instead of a uniform permutation: each element is drawn from source ``k`` with probability
``weights[k]`` (renormalized over the sources not yet empty), from a generator seeded by
``(seed, epoch)`` alone, so the stream is the same whatever the worker count, sharding
(``shard=``) and resume work on it as on any order, and a mid-epoch resume is exact.

Pure: no process, thread or clock.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_MIX_KEY = 0x6D6978  # "mix": the mixture's draws have their own stream of (seed, epoch)


class Mix:
    """Sources drawn from with given weights: each element of an epoch comes from source ``k``
    with probability ``weights[k]`` (normalized; renormalized over the sources not yet empty).

    Args:
        sources: indexed datasets (``len`` and ``[i]``), or ``Mix``es (whose own mixed order
            is kept). ``procpipe.Shards`` cannot be mixed yet.
        weights: one weight >= 0 per source (not all 0), or a callable ``weights(epoch)``
            returning them: a schedule. Changing weights between epochs is allowed; a resumed
            epoch keeps the weights it was saved with (they are in ``Loader.state_dict()``).
        stop_on_empty: ``False`` (default): when a source runs out the epoch goes on with the
            others, so every element of every source comes exactly once per epoch.
            ``True``: the epoch ends when the first source runs out (its length varies by
            epoch; ``len(loader)`` is epoch 0's).

    With ``Loader(shuffle=True)`` each source's own elements are shuffled too (from
    ``(seed, epoch)``); with ``shuffle=False`` each source is read in order, only the
    interleave is random.
    """

    def __init__(self, sources: Sequence[Any], weights: Sequence[float] | Callable[[int], Sequence[float]], *,
                 stop_on_empty: bool = False) -> None:
        if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or not sources:
            raise TypeError("Mix(sources, weights): sources must be a non-empty list of datasets")
        for i, source in enumerate(sources):
            if type(source).__name__ == "Shards" or not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
                raise TypeError(f"Mix: sources[{i}] ({type(source).__name__}) is not an indexed dataset (len and [i]); "
                                "mixing procpipe.Shards streams is not supported yet")
        if not isinstance(stop_on_empty, bool):
            raise TypeError(f"stop_on_empty must be True or False, got {stop_on_empty!r}")
        self.sources = list(sources)
        self.lengths = [len(source) for source in self.sources]
        self.offsets = np.concatenate(([0], np.cumsum(self.lengths))).astype(np.int64)
        self._starts = self.offsets.tolist()  # the same as ints: bisect on a list, not on numpy scalars
        self.stop_on_empty = stop_on_empty
        self.weights = weights
        self.pinned: dict[int, list[float]] = {}  # epoch -> weights a resumed epoch was saved with
        if not callable(weights):
            self.weights_at(0)  # checked here, not in the first epoch

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> Any:
        starts = self._starts
        if not 0 <= index < starts[-1]:
            raise IndexError(f"Mix index {index} out of range (length {starts[-1]})")
        k = bisect.bisect_right(starts, index) - 1
        return self.sources[k][index - starts[k]]

    def __repr__(self) -> str:
        return f"Mix({len(self.sources)} sources, lengths={self.lengths}, stop_on_empty={self.stop_on_empty})"

    def source_of(self, index: int) -> int:
        """The source index ``index`` belongs to."""
        return bisect.bisect_right(self._starts, index) - 1

    def weights_at(self, epoch: int) -> list[float]:
        """The weights of ``epoch``, normalized: pinned by a resume, else given (or the schedule's)."""
        if epoch in self.pinned:
            return self.pinned[epoch]
        raw = self.weights(epoch) if callable(self.weights) else self.weights
        try:
            values = [float(w) for w in raw]
        except (TypeError, ValueError):
            raise TypeError(f"Mix weights must be numbers, one per source, got {raw!r:.200}") from None
        if len(values) != len(self.sources) or any(not np.isfinite(w) or w < 0 for w in values) or not sum(values):
            raise ValueError(f"Mix weights must be {len(self.sources)} finite numbers >= 0, not all 0 (one per "
                             f"source), got {values!r:.200}" + (f" for epoch {epoch}" if callable(self.weights) else ""))
        total = sum(values)
        return [w / total for w in values]

    def epoch_order(self, epoch: int, seed: int, shuffle: bool, reshuffle: bool = True) -> np.ndarray:
        """The indices of ``epoch`` in mixed order (every index once, or fewer with ``stop_on_empty``).

        Drawn in runs: a run draws sources i.i.d. with the current weights, cut where a source
        gives its last element (the same law as drawing one at a time); the weights are then
        renormalized over the rest. A source of weight 0 is never drawn: without
        ``stop_on_empty`` its elements come at the end of the epoch (every element once).
        """
        draw_epoch = epoch if reshuffle else 0
        rng = np.random.default_rng([seed, _MIX_KEY, draw_epoch])
        elements = [self._source_order(k, rng, seed, draw_epoch, shuffle) for k in range(len(self.sources))]
        counts = np.array([len(e) for e in elements], dtype=np.int64)
        weights = np.array(self.weights_at(epoch), dtype=np.float64)
        left = counts.copy()
        live = (left > 0) & (weights > 0)
        picks: list[np.ndarray] = []
        while live.any():
            p = np.where(live, weights, 0.0)
            p /= p.sum()
            # a run of i.i.d. draws, about as long as it takes the first source to run out
            horizon = float(np.min(left[live] / p[live]))
            draws = rng.choice(len(p), size=int(min(left[live].sum(), 1.5 * horizon + 1024)), p=p)
            got = np.bincount(draws, minlength=len(p))
            over = np.flatnonzero(live & (got >= left))
            if len(over):  # cut the run where the first source gives its last element
                cut = min(int(np.flatnonzero(draws == k)[left[k] - 1]) for k in over) + 1
                draws = draws[:cut]
                got = np.bincount(draws, minlength=len(p))
            picks.append(draws)
            left -= got
            if self.stop_on_empty and len(over):
                break
            live = (left > 0) & (weights > 0)
        sources = np.concatenate(picks) if picks else np.zeros(0, np.int64)
        order = np.empty(len(sources), dtype=np.int64)
        for k, element in enumerate(elements):
            where = np.flatnonzero(sources == k)
            order[where] = element[:len(where)] + self.offsets[k]
        if not self.stop_on_empty:
            order = np.concatenate([order] + [elements[k][counts[k] - left[k]:] + self.offsets[k]
                                              for k in range(len(self.sources)) if weights[k] == 0 and left[k]])
        return order

    def _source_order(self, k: int, rng: np.random.Generator, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        source = self.sources[k]
        if isinstance(source, Mix):
            return source.epoch_order(epoch, seed * 1_000_003 + k + 1, shuffle)
        n = self.lengths[k]
        return rng.permutation(n) if shuffle else np.arange(n, dtype=np.int64)

    # ------------------------------------------------------------------ the saved state
    def state(self, epoch: int) -> dict[str, Any]:
        """What ``Loader.state_dict()`` saves about the mixture in ``epoch``."""
        return {"lengths": list(self.lengths), "weights": self.weights_at(epoch), "stop_on_empty": self.stop_on_empty}

    def load(self, state: Any, epoch: int) -> None:
        """A saved ``state()`` checked against this mixture; its weights pinned for ``epoch``."""
        if not isinstance(state, dict) or set(state) != {"lengths", "weights", "stop_on_empty"}:
            raise ValueError("this state was saved by a loader whose source is not a procpipe.Mix (or is corrupt): "
                             f"mix={state!r:.200}; resume with the same source")
        mine = self.state(epoch)
        for key in ("lengths", "stop_on_empty"):
            if state[key] != mine[key]:
                raise ValueError(f"this state was saved with a Mix of {key}={state[key]!r:.200}, but this loader's "
                                 f"Mix has {key}={mine[key]!r:.200}; resume with the same sources")
        weights = state["weights"]
        if (not isinstance(weights, list) or len(weights) != len(self.sources)
                or not all(isinstance(w, (int, float)) and w >= 0 for w in weights) or not sum(weights)):
            raise ValueError(f"corrupt procpipe Loader state: mix weights {weights!r:.200}")
        self.pinned = {epoch: [float(w) for w in weights]}
