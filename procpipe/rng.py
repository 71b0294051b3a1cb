"""Per-sample random numbers: ``sample_rng()`` inside ``fn``.

Determinism is per sample, not per worker: the generator for a sample depends only on
``(seed, epoch, index)``. Output is therefore identical whatever the worker count, the
schedule, or how often a batch had to be re-run after a crash or for a straggler.
"""
from __future__ import annotations

import threading

import numpy as np

# Distinct spawn-key prefixes keep the shuffle stream and the per-sample streams apart.
_SHUFFLE_KEY = 0
_SAMPLE_KEY = 1
_BUFFER_KEY = 3  # streaming sources' shuffle buffer (procpipe.streaming)
_BATCH_KEY = 4  # batch_rng(), inside batch_fn
_DEVICE_KEY = 5  # batch_rng(), inside device_fn (keyed by the batch's position in its epoch)

_current = threading.local()


def _generator(seed: int, kind: int, epoch: int, index: int | tuple[int, ...] | None = None) -> np.random.Generator:
    """The generator of ``(seed, kind, epoch[, index])``; ``index`` is an int, or a streaming
    source's ``(shard, record)`` key (``procpipe.streaming.RecordKey``)."""
    if index is None:
        key: tuple[int, ...] = (kind, epoch)
    elif isinstance(index, tuple):
        key = (kind, epoch, *index)
    else:
        key = (kind, epoch, index)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)))


def shuffle_rng(seed: int, epoch: int) -> np.random.Generator:
    """Generator for the sampler's order of one epoch."""
    return _generator(seed, _SHUFFLE_KEY, epoch)


def buffer_rng(seed: int, epoch: int) -> np.random.Generator:
    """Generator for a streaming source's shuffle buffer in one epoch (``shuffle_buffer=``)."""
    return _generator(seed, _BUFFER_KEY, epoch)


class SampleScope:
    """Marks which sample is being produced, so ``sample_rng()`` can seed from it.

    One instance lives in each worker (and in the consumer for ``workers=0``); ``enter``
    is called before ``source[i]`` and ``fn`` run for index ``i``.
    """

    __slots__ = ("seed", "epoch", "index", "rng")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.epoch = 0
        self.index: int | None = None  # the sample being produced; None between samples
        self.rng: np.random.Generator | None = None

    def enter(self, epoch: int, index: int) -> None:
        self.epoch = epoch
        self.index = index
        self.rng = None  # created lazily: most pipelines never ask for one
        _current.scope = self

    def leave(self) -> None:
        self.index = None
        _current.scope = None


def sample_rng() -> np.random.Generator:
    """The random generator of the sample being produced, seeded from ``(seed, epoch, index)``.

    Call it inside ``fn`` (or the source's ``__getitem__``). Repeated calls while producing
    the same sample return the same generator, so successive draws differ. Outside a
    loader it raises ``RuntimeError``.
    """
    scope = getattr(_current, "scope", None)
    if scope is None:
        raise RuntimeError(getattr(_current, "why_not", None) or (
            "procpipe.sample_rng() was called outside a procpipe.Loader: it only works while a "
            "loader produces a sample (inside fn, augment or the source's __getitem__)."
        ))
    if scope.rng is None:
        scope.rng = _generator(scope.seed, _SAMPLE_KEY, scope.epoch, scope.index)
    return scope.rng


class BatchScope:
    """Marks the batch ``batch_fn`` is transforming, so ``batch_rng()`` can seed from it.

    ``first`` identifies the batch: its first index as the sampler made it, or for a
    streaming source the ``(shard, record)`` key of its first record.
    """

    __slots__ = ("seed", "epoch", "first", "rng")

    def __init__(self, seed: int, epoch: int, first: int | tuple[int, int]) -> None:
        self.seed = seed
        self.epoch = epoch
        self.first = first
        self.rng: np.random.Generator | None = None


class no_sample_rng:
    """Context: ``sample_rng()`` raises ``RuntimeError(why)`` inside it; ``batch`` enables ``batch_rng()``.

    Used around a cached ``fn`` (whose output must not depend on the epoch) and around
    ``batch_fn`` (which works on a whole batch, not one sample).
    """

    __slots__ = ("why", "batch", "saved")

    def __init__(self, why: str, batch: BatchScope | None = None) -> None:
        self.why = why
        self.batch = batch

    def __enter__(self) -> None:
        self.saved = (getattr(_current, "scope", None), getattr(_current, "why_not", None),
                      getattr(_current, "batch", None))
        _current.scope, _current.why_not, _current.batch = None, self.why, self.batch

    def __exit__(self, *exc: object) -> None:
        _current.scope, _current.why_not, _current.batch = self.saved


_NO_SAMPLE_RNG_IN_DEVICE_FN = (
    "procpipe.sample_rng() was called inside device_fn, which works on a whole batch on the device: use "
    "procpipe.batch_rng() there (seeded from (seed, epoch, the batch's position in the epoch)), or draw "
    "per-sample randomness in fn or augment."
)


def device_scope(seed: int, epoch: int, seq: int) -> no_sample_rng:
    """The context ``device_fn`` runs in: ``batch_rng()`` is the generator of ``(seed, epoch,
    seq)`` (``seq``: the batch's position in the epoch's order, the same whatever the
    workers or the delivery order), ``sample_rng()`` is refused."""
    scope = BatchScope(seed, epoch, seq)
    scope.rng = _generator(seed, _DEVICE_KEY, epoch, seq)
    return no_sample_rng(_NO_SAMPLE_RNG_IN_DEVICE_FN, scope)


def batch_rng() -> np.random.Generator:
    """The random generator of the batch ``batch_fn`` (or ``device_fn``) is transforming.

    Seeded from ``(seed, epoch, first index of the batch)`` (for a streaming source: the
    ``(shard, record)`` of the batch's first record), so, like ``sample_rng()``, it does
    not depend on the number of workers or on re-runs. Repeated calls within one
    batch return the same generator. Outside ``batch_fn`` it raises ``RuntimeError``.
    """
    batch = getattr(_current, "batch", None)
    if batch is None:
        raise RuntimeError(
            "procpipe.batch_rng() only works inside batch_fn or device_fn (a Loader's batch-level functions); "
            "in fn, augment or __getitem__ use procpipe.sample_rng()."
        )
    if batch.rng is None:
        batch.rng = _generator(batch.seed, _BATCH_KEY, batch.epoch, batch.first)
    return batch.rng
