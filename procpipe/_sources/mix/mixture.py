"""Weighted mixtures of indexed sources: ``procpipe.Mix`` and its sampler, ``MixOrder``.

``Mix(sources, weights)`` is tf.data's ``sample_from_datasets`` for procpipe: each element of
an epoch is drawn from source ``k`` with probability ``weights[k]``, deterministically from
``(seed, epoch)``. A mixture of indexed sources is itself an indexed source: a *virtual
dataset* whose index space is the concatenation of its sources' (index ``g`` is element
``g - offsets[k]`` of source ``k``), so workers, the cache, ``sample_rng()``, sharding and
resume see ordinary indices. Only the *order* of an epoch is special: ``MixOrder`` (where a
``indexed.index_order.IndexOrder`` would be) builds it as an interleaving of each source's own order
(a permutation from ``(seed, epoch)`` and the sources' lengths with ``shuffle=True``, else ``0, 1, ...``), the
choice of the source of each element drawn from the weights in force for that epoch.

The draw (``_arrivals``): with ``stop_on_empty=False`` each element comes from source ``k``
with probability ``weights[k]`` renormalised over the sources not yet exhausted, so every
element of every source with a weight > 0 comes exactly once; with ``stop_on_empty=True``
sources are drawn with the weights as given and the epoch ends at the first draw of a
source that has run out (tf.data's ``stop_on_empty_dataset``). Both are drawn at once as
races: source ``k``'s elements arrive at the times of a Poisson process of rate
``weights[k]`` (cumulative sums of exponential gaps), and the epoch is every arrival sorted
by time. The next arrival among the sources still arriving is from ``k`` with probability
``weights[k]`` over their sum (exponentials forget), which is the renormalised draw; with
``stop_on_empty`` each source gets one arrival more, its "empty" draw, and the epoch ends
before the first of those. One exponential per element and one sort, whatever the number of
sources. Memory: a few arrays of the epoch's length while it is planned, then its order
(one int64 per element, as ``IndexOrder``'s); no array per source survives.

A mixture of streams (``procpipe.Shards``) has shards for elements: ``len(Shards)`` is its
number of shards, so the same ``Mix.order`` gives the order an epoch opens shards in
(``_sources/mix/mix_shards.py`` builds the stream plan around it); an indexed source beside streams counts
as its number of slices (``_sources/mix/slice_sizes.py``).

Weights may follow a schedule (a callable ``epoch -> weights``, or ``Mix.set_weights``);
the weights used for each epoch are recorded here, saved in ``Loader.state_dict()``
(``mix_weights``) and pinned again on load, so a resumed epoch is the very same order; the
loader's own weights apply from the next epoch on.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..epoch_order import GivenOrders, epoch_order
from ..indexed.index_order import order_options
from ..indexed.index_plan import IndexPlan
from ..stream.shards import Shards
from .slice_sizes import indexed_shard_size, virtual_shards

if TYPE_CHECKING:
    from ...config import Batching

_MIX_KEY = 0x4D6978  # spawn-key prefix of every mixture stream ("Mix"), apart from core.rng's keys
_DRAW, _PERMUTE = 0, 1
_KEEP_EPOCHS = 8  # epochs whose weights the sampler remembers (a state names the resumed and later ones)

Weights = Sequence[float] | np.ndarray
WeightsSetting = Weights | Callable[[int], Weights]


def _rng(seed: int, epoch: int, path: tuple[int, ...], *rest: int) -> np.random.Generator:
    key = (_MIX_KEY, epoch, len(path), *path, *rest)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


class Mix:
    """A weighted mixture of sources, itself a source for ``procpipe.Loader``.

    Each element of an epoch comes from source ``k`` with probability ``weights[k]``; which
    source gives each element is drawn from ``(seed, epoch)`` (the Loader's ``seed``), so the
    stream is the same whatever the worker count, and a resumed epoch is exact. Each source
    is read in its own order: a permutation from ``(seed, epoch)`` with the Loader's
    ``shuffle=True``, else ``0, 1, 2, ...``.

    Args:
        sources: indexed datasets (``len`` + ``__getitem__``), or mixtures (nested: a ``Mix``
            among the sources is read in its own mixed order); or streams (``procpipe.Shards``,
            or mixtures of them), whose **shards** are drawn by weight
            (``procpipe._sources.mix.mix_shards``), then read in the stream's interleave. Indexed datasets
            and streams together make a stream: each indexed dataset is read as shards of
            ``shard_size`` elements of its epoch order (``_sources.mix.slice_sizes``).
        weights: one number >= 0 per source (any scale: they are normalised), or a callable
            ``epoch -> weights`` (a schedule, called in the calling process when an epoch is
            planned). A source with weight 0 is left out of that epoch.
        stop_on_empty: ``False`` (default): when a source runs out, the others go on (their
            weights renormalised), so an epoch holds every element of every source with a
            weight > 0 exactly once. ``True``: the epoch ends at the first draw of a source
            that has run out (tf.data's ``stop_on_empty_dataset=True``): the proportions
            hold to the end, and the epoch is shorter.
        with_source: ``True``: ``mix[i]`` (what ``fn`` receives) is ``(k, element)``, ``k``
            the position of the source in ``sources`` (a stream's records: ``(k, record)``);
            ``False`` (default): the element.
        shard_size: in a mixture of indexed datasets and streams, the elements of each shard an
            indexed dataset is read as (its weight is then per shard, as a stream's); ``None``
            (default): the streams' mean records per shard, from their ``Shards(lengths=...)``.

    ``len(mix)`` is the number of elements of all sources (of shards, for streams); ``mix[i]`` is element
    ``i - offset`` of the source holding index ``i`` (``source_of(i)``). A Loader over a mixture
    saves the weights of the epoch it is in with ``state_dict()``; see ``set_weights``.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        weights: WeightsSetting,
        *,
        stop_on_empty: bool = False,
        with_source: bool = False,
        shard_size: int | None = None,
    ) -> None:
        sources = check_sources(sources)
        for name, value in (("stop_on_empty", stop_on_empty), ("with_source", with_source)):
            if not isinstance(value, bool):
                raise TypeError(f"Mix: {name} must be True or False, got {value!r}")
        check_mix_weights(weights, len(sources))
        self.sources: list[Any] = sources
        # streams: an index is a shard, and an epoch an order of shards (an indexed source among
        # them is read as shards of shard_size elements: _sources/mix/slice_sizes.py)
        self.streaming = any(is_stream(s) for s in sources)
        self.shard_size = indexed_shard_size(sources, shard_size, is_stream, _leaves_of)
        self.stop_on_empty = bool(stop_on_empty)
        self.with_source = bool(with_source)
        lengths = np.array([self._length(s) for s in sources], dtype=np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(lengths)))  # source k holds offsets[k] .. offsets[k+1]-1
        self._starts: list[int] = self.offsets.tolist()  # the same as ints, for bisect (one lookup per element)
        self._weights: WeightsSetting = weights
        if not callable(weights):
            self._weights = self._checked(weights, None)

    def _length(self, source: Any) -> int:
        """``source``'s length in this mixture's index space: elements, or shards for streams (an
        indexed source beside streams: its number of slices of ``shard_size`` elements)."""
        if self.shard_size is not None and not is_stream(source):
            return virtual_shards(len(source), self.shard_size)
        return len(source)

    # ---- the dataset
    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> Any:
        starts = self._starts
        if type(index) is int and 0 <= index < starts[-1] and not self.streaming:  # the workers' case, inlined
            k = bisect.bisect_right(starts, index) - 1
            local = index - starts[k]
        elif self.streaming:
            raise TypeError("a Mix of streams (procpipe.Shards) is read by procpipe.Loader, not indexed")
        else:
            k, local = self.source_of(index)
        item = self.sources[k][local]
        return (k, item) if self.with_source else item

    def source_of(self, index: int) -> tuple[int, int]:
        """``(k, i)``: index ``index`` of the mixture is element ``i`` of ``sources[k]``."""
        starts = self._starts
        index = operator.index(index)
        if index < 0:
            index += starts[-1]
        if not 0 <= index < starts[-1]:
            raise IndexError(f"index {index} out of range for a Mix of {starts[-1]} elements")
        k = bisect.bisect_right(starts, index) - 1  # (past any empty source sharing its start)
        return k, index - starts[k]

    def __getstate__(self) -> dict[str, Any]:
        # A worker only reads elements: the schedule (maybe an unpicklable closure) stays here.
        state = dict(self.__dict__)
        state["_weights"] = None
        return state

    def __repr__(self) -> str:
        # (a mixture holding a stream counts shards: an indexed source's slices of shard_size among them)
        unit = "shards" if self.streaming else "elements"
        return f"Mix({len(self.sources)} sources, {len(self)} {unit}, stop_on_empty={self.stop_on_empty})"

    # ---- the weights
    def set_weights(self, weights: WeightsSetting) -> None:
        """Replace the weights (a sequence, or a callable ``epoch -> weights``) for every epoch
        planned from now on: call it between iterations (``iter(loader)`` plans an epoch when it
        starts; with ``epochs=N`` the next epoch is planned before this one ends, so a schedule
        inside one iteration is a callable). An epoch already begun keeps the weights it
        started with, also after ``load_state_dict``."""
        check_mix_weights(weights, len(self.sources))
        self._weights = weights if callable(weights) else self._checked(weights, None)

    def weights_for(self, epoch: int) -> list[float]:
        """The weights (as given, not normalised) this mixture uses for ``epoch``."""
        weights = self._weights
        if weights is None:
            raise RuntimeError("this Mix is a worker's copy: its weights stay in the calling process")
        return self._checked(weights(epoch), epoch) if callable(weights) else list(weights)

    def _checked(self, weights: Any, epoch: int | None) -> list[float]:
        where = "" if epoch is None else f" (the schedule's weights for epoch {epoch})"
        return check_mix_weights(weights, len(self.sources), where)

    def nodes(self) -> list[Mix]:
        """This mixture and the mixtures nested in it, depth first (the order of saved weights)."""
        out = [self]
        for source in self.sources:
            if isinstance(source, Mix):
                out.extend(source.nodes())
        return out

    def leaves(self) -> list[Any]:
        """The sources that are not mixtures, depth first: the order of the mixture's index space."""
        out: list[Any] = []
        for source in self.sources:
            out.extend(source.leaves() if isinstance(source, Mix) else [source])
        return out

    def leaf_parents(self) -> list[Mix]:
        """For each of ``leaves()``, the mixture holding it directly (whose ``shard_size`` it is read with)."""
        return [p for source in self.sources for p in (source.leaf_parents() if isinstance(source, Mix) else [self])]

    def leaf_owners(self) -> list[int]:
        """For each of ``leaves()``, the index of the source of this mixture that holds it."""
        return [k for k, source in enumerate(self.sources) for _ in _leaves_of(source)]

    def structure(self) -> list[Any]:
        """What a saved state must match: each source's length, a nested mixture as its own list
        (an indexed source beside streams: its elements and the size of its shards)."""
        return [
            source.structure()
            if isinstance(source, Mix)
            else {"elements": len(source), "shard_size": self.shard_size}
            if self.shard_size is not None and not is_stream(source)
            else len(source)
            for source in self.sources
        ]

    # ---- an epoch's order
    def order(
        self, seed: int, epoch: int, shuffle: bool, weights: list[list[float]], path: tuple[int, ...] = ()
    ) -> np.ndarray:
        """The indices of this mixture in ``epoch``'s order (int64; shorter than ``len(self)``
        with ``stop_on_empty`` or a weight 0). ``weights``: ``nodes()``' weights, consumed from
        the front (depth first); ``epoch`` is the one that keys the draws (``reshuffle=False``: 0)."""
        mine = np.asarray(weights.pop(0), dtype=np.float64)
        inner: dict[int, np.ndarray] = {}
        for k, source in enumerate(self.sources):  # nested orders first: their lengths are their epoch's
            if isinstance(source, Mix):
                inner[k] = source.order(seed, epoch, shuffle, weights, (*path, k))
        lengths = np.array(
            [len(inner[k]) if k in inner else self._length(s) for k, s in enumerate(self.sources)], dtype=np.int64
        )
        counts, order = _arrivals(_rng(seed, epoch, path, _DRAW), mine, lengths, self.stop_on_empty)
        parts = []  # each source's elements in its own order, source after source
        permute = _rng(seed, epoch, path, _PERMUTE) if shuffle else None
        for k in range(len(self.sources)):
            count = int(counts[k])
            if k in inner:
                local = inner.pop(k)[:count]
            elif permute is not None and lengths[k]:  # every source's, used or not: one depends on the lengths only
                local = permute.permutation(int(lengths[k]))[:count]
            else:
                local = np.arange(count)
            if count:
                parts.append(local + self.offsets[k])
        return np.concatenate(parts)[order] if parts else np.empty(0, dtype=np.int64)


def _arrivals(
    rng: np.random.Generator, weights: np.ndarray, lengths: np.ndarray, stop_on_empty: bool
) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, order)``: how many elements each source gives this epoch, and the epoch's
    order as positions into those elements laid out source after source (source 0's first
    ``counts[0]``, then source 1's...): ``order[i]`` is the ``i``-th element of the epoch."""
    drawn = weights > 0 if stop_on_empty else (weights > 0) & (lengths > 0)
    sources = np.flatnonzero(drawn)
    counts = np.zeros(len(weights), dtype=np.int64)
    if not len(sources):
        return counts, np.empty(0, dtype=np.int64)
    arrivals = lengths[sources] + (1 if stop_on_empty else 0)  # stop_on_empty: each source's empty draw too
    times = rng.standard_exponential(int(arrivals.sum()))
    start = 0
    for k, n in zip(sources.tolist(), arrivals.tolist(), strict=True):  # each source's clock, at its own rate
        segment = times[start : start + n]
        np.cumsum(segment, out=segment)
        segment /= weights[k]
        start += n
    counts[sources] = arrivals
    if stop_on_empty:
        ends = np.cumsum(arrivals) - 1
        cutoff = times[ends].min()  # the first empty draw ends the epoch
        keep = times < cutoff  # (a prefix of each source's arrivals: its clock only goes forward)
        counts[sources] = np.add.reduceat(keep, np.concatenate(([0], ends[:-1] + 1)))
        times = times[keep]
    return counts, np.argsort(times, kind="stable")


class MixOrder:
    """The batches of each epoch of a ``Mix`` (where ``indexed.index_order.IndexOrder`` would be).

    Same settings and sharding as ``IndexOrder`` (``shard``: this rank's part of the epoch's
    order, padded by repetition to a multiple of ``world_size``), with the order from
    ``Mix.order``. ``len()`` is an upper bound, exact with ``stop_on_empty=False`` and every
    weight > 0: the batches of an epoch holding every element of every source. The weights
    of each epoch planned are kept (``weights``), and a loaded state pins those of the
    epochs it names (``pin``).
    """

    epoch_plan = IndexPlan  # each epoch: a fixed list of batches (_sources/indexed/index_plan.py)

    @classmethod
    def of(cls, length: int, batching: Batching, mix: Mix) -> MixOrder:
        """A mixture's order of ``length`` samples, from a Loader's batching group (config.py)."""
        return cls(length, **order_options(batching), mix=mix)

    def __init__(
        self,
        length: int,
        batch_size: int | None,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        shard: tuple[int, int] | None = None,
        reshuffle: bool = True,
        *,
        mix: Mix,
    ) -> None:
        self.mix = mix
        self.length = length
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.shard = shard
        self.reshuffle = reshuffle
        self._used: dict[int, list[list[float]]] = {}  # epoch -> the weights it was planned with
        self._pinned: dict[int, list[list[float]]] = {}  # epoch -> weights from a loaded state
        self.given = GivenOrders()  # epochs whose order a combined state gives (IndexOrder.given; _sources/combine.py)

    @property
    def step(self) -> int:
        return 1 if self.batch_size is None else self.batch_size

    def _batch_count(self, samples: int) -> int:
        count = samples if self.shard is None else -(-samples // self.shard[1])
        return count // self.step if self.drop_last else -(-count // self.step)

    def __len__(self) -> int:
        return self._batch_count(self.length)

    def weights(self, epoch: int) -> list[list[float]]:
        """The weights of every node of the mixture (``Mix.nodes()``) for ``epoch``: those a loaded
        state pinned, else those it was planned with, else the mixture's own now."""
        if epoch in self._pinned:
            return self._pinned[epoch]
        if epoch in self._used:
            return self._used[epoch]
        return [node.weights_for(epoch) for node in self.mix.nodes()]

    @property
    def mixing(self) -> MixOrder:
        """What keeps the weights of each epoch (_sources/saved_state.py asks every sampler for one): itself."""
        return self

    def mixed_order(self, epoch: int, record: bool = True) -> np.ndarray:
        """``Mix.order`` of ``epoch`` with the weights of ``weights(epoch)``, before sharding;
        ``record``: the epoch is being planned, so those weights are its from now on."""
        weights = self.weights(epoch)
        if record:
            self._used[epoch] = weights
            for old in [e for e in self._used if e < epoch - _KEEP_EPOCHS]:
                del self._used[old]
        return self.mix.order(self.seed, epoch if self.reshuffle else 0, self.shuffle, [list(w) for w in weights])

    def order(self, epoch: int) -> np.ndarray:
        """This rank's part of ``epoch``'s order (indices of the mixture)."""
        given = self.given.order(epoch)
        if given is not None:
            return given
        order = self.mixed_order(epoch)
        if self.shard is None or not len(order):
            return order
        # IndexOrder's sharding (plan.sampler.epoch_order) of this epoch's order: padded, then every world-th.
        world = self.shard[1]
        return order[
            epoch_order(len(order), epoch, False, self.seed, True, self.shard, pad_to=-(-len(order) // world) * world)
        ]

    def batches(self, epoch: int) -> list[list[int]]:
        """The index lists of every batch of ``epoch``, in delivery order."""
        order = self.order(epoch).tolist()
        step = self.step
        count = len(order) // step if self.drop_last else -(-len(order) // step)
        return [order[i * step : (i + 1) * step] for i in range(count)]

    # ---- the state (_sources/saved_state.py)
    def settings(self) -> dict[str, Any]:
        """What a saved state must match, beyond ``IndexOrder``'s settings."""
        return {"mix": {"lengths": self.mix.structure(), "stop_on_empty": self.mix.stop_on_empty}}

    def save_weights(self, epochs: list[int]) -> dict[str, Any]:
        """``mix_weights``: ``[epoch, weights]`` for the epochs a state names (resumed, ahead)."""
        return {"mix_weights": [[e, self.weights(e)] for e in sorted(set(epochs))]}

    def pin(self, state: dict[str, Any]) -> dict[int, list[list[float]]]:
        """Take the weights a state was saved with (``mix_weights``, checked): the epochs it names
        are planned with them again, whatever this mixture's weights are now; the others with the
        mixture's own. Returns the pins it replaced (``unpin``: a load that fails after this
        leaves the sampler as it was)."""
        saved = state.get("mix_weights")
        nodes = self.mix.nodes()
        if not isinstance(saved, list):
            raise ValueError(  # noqa: TRY004 - a corrupt saved state: bad data, as every state check says
                f"corrupt procpipe Loader state: mix_weights={saved!r:.200} (a list of "
                "[epoch, weights] from a loader over a procpipe.Mix)"
            )
        pinned: dict[int, list[list[float]]] = {}
        for entry in saved:
            if not (
                isinstance(entry, list)
                and len(entry) == 2
                and isinstance(entry[1], list)
                and len(entry[1]) == len(nodes)
                and type(entry[0]) is int
                and entry[0] >= 0
            ):
                raise ValueError(f"corrupt procpipe Loader state: mix_weights entry {entry!r:.200}")
            try:
                pinned[entry[0]] = [
                    check_mix_weights(w, len(node.sources)) for w, node in zip(entry[1], nodes, strict=True)
                ]
            except (TypeError, ValueError) as e:
                raise ValueError(f"corrupt procpipe Loader state: mix_weights for epoch {entry[0]}: {e}") from None
        previous, self._pinned = self._pinned, pinned
        return previous

    def unpin(self, previous: dict[int, list[list[float]]]) -> None:
        """Put back the pins ``pin`` replaced."""
        self._pinned = previous

    def check_pinned(self, epochs: list[int]) -> None:
        """After ``pin``, the load's last step: every epoch a loaded state resumes had its weights in
        it. The weights of the epochs planned before are forgotten (the loader starts again there)."""
        missing = [e for e in epochs if e not in self._pinned]
        if missing:
            raise ValueError(f"corrupt procpipe Loader state: no mix_weights for epoch(s) {missing}")
        self._used.clear()


# ---- checks (here, not in config.py: a Mix is built, and its weights set, before any Loader)
def check_sources(sources: Any) -> list[Any]:
    """``sources`` as a list of indexed sources or mixtures; raises naming the first one wrong."""
    if isinstance(sources, (str, bytes)) or not hasattr(sources, "__iter__"):
        raise TypeError(f"Mix: sources must be a list of datasets, got {type(sources).__name__}")
    sources = list(sources)
    if not sources:
        raise ValueError("Mix: sources is empty; give at least one dataset")
    streams = [is_stream(source) for source in sources]
    if any(streams):
        for k, source in enumerate(sources):
            if isinstance(source, Mix) and not source.streaming:
                raise TypeError(
                    f"Mix: sources[{k}] is a mixture of indexed datasets, nested in a mixture with streams "
                    "(procpipe.Shards), which mixes shards, not elements; give its datasets to this mixture "
                    "directly (each is then read as shards, with its own weight)"
                )
    for k, source in enumerate(sources):
        if streams[k]:
            continue
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise TypeError(
                f"Mix: sources[{k}] ({type(source).__name__}) must support len() and indexing with "
                "an int (a list, a numpy array, a torch Dataset, a Mix...)"
            )
    return sources


def _leaves_of(source: Any) -> list[Any]:
    return source.leaves() if isinstance(source, Mix) else [source]


def is_stream(source: Any) -> bool:
    """``source`` is a ``procpipe.Shards`` or a mixture of them (a Loader's source: _sources/resolve.py)."""
    return (isinstance(source, Mix) and source.streaming) or isinstance(source, Shards)


def check_mix_weights(weights: Any, count: int, where: str = "") -> Any:
    """``weights`` checked: a callable (checked when called), or ``count`` numbers >= 0, finite, not all
    0; returns them as a list of floats (the callable as it is)."""
    if callable(weights) and not where:
        return weights
    try:
        values = list(weights)
    except TypeError:
        raise TypeError(
            f"Mix: weights{where} must be a sequence of {count} numbers (one per source) or a "
            f"callable epoch -> weights, got {type(weights).__name__}"
        ) from None
    if len(values) != count:
        raise ValueError(f"Mix: weights{where} has {len(values)} entries for {count} sources; give one per source")
    for k, value in enumerate(values):
        if not (
            isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_))
            and math.isfinite(float(value))
            and float(value) >= 0
        ):
            raise ValueError(f"Mix: weights{where}[{k}] = {value!r}; every weight must be a finite number >= 0")
    floats = [float(v) for v in values]
    if not sum(floats) > 0:
        raise ValueError(f"Mix: weights{where} are all 0; at least one source needs a weight > 0")
    return floats
