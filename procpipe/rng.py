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

_current = threading.local()


def shuffle_rng(seed: int, epoch: int) -> np.random.Generator:
    """Generator for the sampler's order of one epoch."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(_SHUFFLE_KEY, epoch))))


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
        raise RuntimeError(
            "procpipe.sample_rng() was called outside a procpipe.Loader: it only works while a "
            "loader produces a sample (inside fn or the source's __getitem__)."
        )
    if scope.rng is None:
        seq = np.random.SeedSequence(scope.seed, spawn_key=(_SAMPLE_KEY, scope.epoch, scope.index))
        scope.rng = np.random.Generator(np.random.PCG64(seq))
    return scope.rng
