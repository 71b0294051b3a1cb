"""Per-sample random numbers: ``sample_rng()`` inside ``fn``.

Determinism is per sample, not per worker: the generator for a sample depends only on
``(seed, epoch, index)``. Output is therefore identical whatever the worker count, the
schedule, or how often a batch had to be re-run after a crash or for a straggler.

The process's *global* generators (Python's ``random``, ``np.random`` and, if the process
has imported it, torch's) are seeded too (``SampleScope``, ``seed_globals``), so existing
code that draws from them, torchvision-style transforms included, gets different values
per sample and the same values on every run:

- ``"task"`` (``seed_globals=True``, the default): once per task, before its first sample,
  from ``(seed, epoch, the task's first index or record key)``. A task is a batch (or a
  streaming source's block): which samples it holds, in which order, comes from the
  sampler alone, so the draws do not depend on the worker count, the schedule, re-runs or
  speculation either. Seeding costs about 12 us (the Mersenne Twister's initialisation,
  ``random`` and ``np.random``): once per batch instead of once per sample.
- ``"sample"``: before every sample, from ``(seed, epoch, index)``: a sample's draws do not
  depend on the batch it is in (``batches=`` that change per epoch, ``drop_last``...),
  at ~12 us a sample.
- ``False``: left alone.

Before a batch's ``collate_fn`` and ``batch_fn`` they are seeded from the batch's first
index (either mode). A cached stage (``cache=``) runs under its sample's own seed for epoch
0 (whichever epoch fills the cache), and the task's stream goes on afterwards as if the
cache had been hit, so the output does not depend on which attempt filled the cache. In
the calling process (``workers=0``, the cache's first sample) their state is put back after
each batch: the caller's own draws are not disturbed.
"""

from __future__ import annotations

import _random
import random
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.random

# Distinct spawn-key prefixes keep the shuffle stream and the per-sample streams apart.
_SHUFFLE_KEY = 0
_SAMPLE_KEY = 1
_BUFFER_KEY = 3  # streaming sources' shuffle buffer (procpipe._sources.stream)
_BATCH_KEY = 4  # batch_rng(), inside batch_fn
_DEVICE_KEY = 5  # batch_rng(), inside device_fn (keyed by the batch's position in its epoch)

_current = threading.local()
_MASK64 = (1 << 64) - 1
# In a batch's global seed, where a sample's has its index (no index or shard is this large).
_COLLATION_MARK = _MASK64
_TASK_MARK = _MASK64 - 1  # in a task's global seed, before its first index

TASK = "task"
SAMPLE = "sample"
SEED_GLOBALS = (True, False, TASK, SAMPLE)


def seeding_mode(seed_globals: bool | str | None) -> str | None:
    """``seed_globals`` as a mode: ``"task"`` (``True``), ``"sample"`` or None (``False``: off)."""
    if seed_globals is None or seed_globals is False:
        return None
    if seed_globals is True or seed_globals == TASK:
        return TASK
    if seed_globals == SAMPLE:
        return SAMPLE
    raise ValueError(
        f"seed_globals must be True (= 'task': the global generators seeded once per batch), "
        f"'sample' (before every sample) or False (left alone), got {seed_globals!r}"
    )


_MIX_START = 0x243F6A8885A308D3


def mix_seed(*values: int) -> int:
    """A well-spread 64-bit seed from a few ints (splitmix64 steps)."""
    return _mix_on(_MIX_START, values)


def _mix_on(x: int, values: tuple[int, ...]) -> int:
    """``mix_seed`` of some values, then ``values``: ``x`` is ``mix_seed`` of the former (the
    steps are sequential, so a common prefix, e.g. ``(seed, epoch)``, is mixed once)."""
    for v in values:
        x = (x ^ (v & _MASK64)) * 0x9E3779B97F4A7C15 & _MASK64
        x ^= x >> 30
        x = x * 0xBF58476D1CE4E5B9 & _MASK64
        x ^= x >> 27
        x = x * 0x94D049BB133111EB & _MASK64
        x ^= x >> 31
    return x


def _torch_generator() -> Any:
    """torch's default CPU generator if this process has imported torch (never imports it)."""
    torch = sys.modules.get("torch")
    return getattr(torch, "default_generator", None)


# ``random.seed(n)`` for an int n is the C seeding of the module's instance, then ``gauss_next
# = None``: called directly, without ``Random.seed``'s Python-level type checks (once per sample).
# ``random.seed`` is the bound method of the module's hidden ``random.Random`` instance, whose C
# base class ``_random.Random`` holds the C ``seed``. ``Any``: typeshed declares ``random.seed`` a
# plain function (no ``__self__``) and ``Random`` without its ``gauss_next`` attribute.
_RANDOM: Any = random.seed.__self__  # type: ignore[attr-defined]  # typeshed: random.seed is a function
_C_SEED = _random.Random.seed  # = random.Random.__mro__[1].seed


def seed_global_generators(seed: int) -> None:
    """Seed ``random``, ``np.random`` and (if imported) torch's default generator from ``seed``
    (exactly as ``random.seed(seed)`` and ``np.random.seed(seed & 0xFFFFFFFF)`` would)."""
    _C_SEED(_RANDOM, seed)
    _RANDOM.gauss_next = None
    np.random.seed(seed & 0xFFFFFFFF)
    generator = _torch_generator()
    if generator is not None:
        generator.manual_seed(seed)


def _global_states() -> tuple[Any, Any, Any, Any]:
    generator = _torch_generator()
    return (random.getstate(), np.random.get_state(), generator, None if generator is None else generator.get_state())


def _restore_global_states(saved: tuple[Any, Any, Any, Any]) -> None:
    py_state, np_state, generator, torch_state = saved
    random.setstate(py_state)
    np.random.set_state(np_state)
    if generator is not None:
        generator.set_state(torch_state)


def _generator(seed: int, kind: int, epoch: int, index: int | tuple[int, ...] | None = None) -> np.random.Generator:
    """The generator of ``(seed, kind, epoch[, index])``; ``index`` is an int, or a streaming
    source's ``(shard, record)`` key (``procpipe._sources.stream.RecordKey``)."""
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
    is called before ``source[i]`` and ``fn`` run for index ``i``, ``leave`` once the task (a
    batch, a block) is done. With ``seed_globals`` (``seeding_mode``) it also seeds the global
    generators: at the first ``enter`` of a task from ``(seed, epoch, index)`` (``"task"``),
    or at every ``enter`` (``"sample"``; module doc). With ``restore_globals`` (the calling
    process) their states are saved at the first ``enter`` and put back by ``leave``.
    """

    __slots__ = (
        "_mixed",
        "_per_sample",
        "_saved",
        "_task_first",
        "epoch",
        "index",
        "restore_globals",
        "rng",
        "seed",
        "seed_globals",
    )

    def __init__(self, seed: int, seed_globals: bool | str | None = False, restore_globals: bool = False) -> None:
        self.seed = seed
        self.epoch = 0
        self.index: int | tuple[int, ...] | None = None  # the sample being produced; None between samples
        self.rng: np.random.Generator | None = None
        self.seed_globals = seeding_mode(seed_globals)
        self._per_sample = self.seed_globals == SAMPLE
        self._task_first: int | tuple[int, ...] | None = None  # the open task's first index (None: no task open)
        self.restore_globals = restore_globals
        self._saved: tuple[Any, Any, Any, Any] | None = None
        self._mixed = (-1, 0)  # (epoch, mix_seed(seed, epoch)): the part of every global seed shared by an epoch

    def _epoch_mix(self, epoch: int) -> int:
        mixed_epoch, mixed = self._mixed
        if mixed_epoch != epoch:
            mixed = mix_seed(self.seed, epoch)
            self._mixed = (epoch, mixed)
        return mixed

    def enter(self, epoch: int, index: int | tuple[int, ...]) -> None:
        self.epoch = epoch
        self.index = index
        self.rng = None  # created lazily: most pipelines never ask for one
        _current.scope = self
        if self.seed_globals:
            if self._per_sample:
                self._save_globals()
                self._seed_globals(epoch, index)
            elif self._task_first is None:  # the task's first sample
                self._save_globals()
                self._task_first = index
                self._seed_globals(epoch, index, (_TASK_MARK,))

    def each(self, epoch: int, indices: Sequence[int]) -> Iterator[int]:
        """Enter each of a task's ``indices`` in turn, as ``enter`` would, and yield it: an indexed
        task's loop, without a call per sample. Past the task's first sample (unless the global
        generators are seeded per sample) entering one only names it: the first seeded them."""
        if self._per_sample:
            for index in indices:
                self.enter(epoch, index)
                yield index
            return
        current = _current
        seeds = self.seed_globals
        first = True
        for index in indices:
            if first or (seeds and self._task_first is None):  # (None again: a leave inside fn)
                first = False
                self.enter(epoch, index)
            else:
                self.index = index
                self.rng = None
                current.scope = self  # (a scope entered and left inside fn, a nested loader's, cleared it)
            yield index

    def reseed_globals(self) -> None:
        """Seed the global generators again as they were when the current sample began (e.g.
        after a worker's set-up code re-seeded them; with ``"task"``, exact for a task's first
        sample, and the sample's own seed for a later one)."""
        index = self.index
        assert index is not None, "reseed_globals is called while a sample is being produced"
        if self._per_sample or index != self._task_first:
            self._seed_globals(self.epoch, index)
        else:
            self._seed_globals(self.epoch, index, (_TASK_MARK,))

    @contextmanager
    def own_seed(self) -> Iterator[None]:
        """Around a cached stage's computation: it draws from its sample's own seed, that of
        epoch 0 whichever epoch computes it (what is cached does not depend on when), then the
        task's stream goes on as it was (as if the cache had been hit: module doc)."""
        if not self.seed_globals:
            yield
            return
        index = self.index
        assert index is not None, "own_seed is entered while a sample is being produced"
        saved = _global_states()
        self._seed_globals(0, index)
        try:
            yield
        finally:
            _restore_global_states(saved)

    def collating(self, epoch: int, first: int | tuple[int, ...]) -> None:
        """The samples are done; the batch whose first index (or record key) is ``first`` is
        collated next. With ``seed_globals`` the global generators are seeded for it from
        ``(seed, epoch, first)`` (apart from every sample's seed), so draws in ``collate_fn`` and
        ``batch_fn`` are the same in a worker and in the calling process; ``leave`` ends it."""
        self.index = None
        _current.scope = None
        if self.seed_globals:
            self._save_globals()
            self._seed_globals(epoch, first, (_COLLATION_MARK,))

    def _save_globals(self) -> None:
        """In the calling process, keep the caller's generator states (once, until ``leave``)."""
        if self.restore_globals and self._saved is None:
            self._saved = _global_states()

    def _seed_globals(self, epoch: int, key: int | tuple[int, ...], mark: tuple[int, ...] = ()) -> None:
        """Seed the global generators from ``mix_seed(seed, epoch, *mark, *key)``."""
        keys = key if isinstance(key, tuple) else (key,)
        seed_global_generators(_mix_on(self._epoch_mix(epoch), (*mark, *keys)))

    def leave(self) -> None:
        """The task is over (its samples, collation, ``batch_fn``): the next ``enter`` opens a new one."""
        self.index = None
        self._task_first = None
        _current.scope = None
        if self._saved is not None:
            saved, self._saved = self._saved, None
            _restore_global_states(saved)


def reseed_current_sample() -> None:
    """Seed the global generators again for the sample being produced, if the loader seeds
    them (``seed_globals``); nothing outside a sample. For adapters whose per-process set-up
    runs inside the first sample and re-seeds the generators (procpipe.torch)."""
    scope = getattr(_current, "scope", None)
    if scope is not None and scope.seed_globals and scope.index is not None:
        scope.reseed_globals()


def sample_rng() -> np.random.Generator:
    """The random generator of the sample being produced, seeded from ``(seed, epoch, index)``.

    Call it inside ``fn`` (or the source's ``__getitem__``). Repeated calls while producing
    the same sample return the same generator, so successive draws differ. Outside a
    loader it raises ``RuntimeError``.
    """
    scope = getattr(_current, "scope", None)
    if scope is None:
        raise RuntimeError(
            getattr(_current, "why_not", None)
            or (
                "procpipe.sample_rng() was called outside a procpipe.Loader: it only works while a "
                "loader produces a sample (inside fn, augment or the source's __getitem__)."
            )
        )
    if scope.rng is None:
        scope.rng = _generator(scope.seed, _SAMPLE_KEY, scope.epoch, scope.index)
    return scope.rng


class BatchScope:
    """Marks the batch ``batch_fn`` is transforming, so ``batch_rng()`` can seed from it.

    ``first`` identifies the batch: its first index as the sampler made it, or for a
    streaming source the ``(shard, record)`` key of its first record.
    """

    __slots__ = ("epoch", "first", "key", "rng", "seed")

    def __init__(self, seed: int, epoch: int, first: int | tuple[int, int], key: int | None = None) -> None:
        self.seed = seed
        self.epoch = epoch
        self.first = first
        self.key = _BATCH_KEY if key is None else key  # batch_fn's stream, or device_fn's
        self.rng: np.random.Generator | None = None  # made on the first batch_rng() call only


class no_sample_rng:
    """Context: ``sample_rng()`` raises ``RuntimeError(why)`` inside it; ``batch`` enables ``batch_rng()``.

    Used around a cached ``fn`` (whose output must not depend on the epoch) and around
    ``batch_fn`` (which works on a whole batch, not one sample).
    """

    __slots__ = ("batch", "saved", "why")

    def __init__(self, why: str, batch: BatchScope | None = None) -> None:
        self.why = why
        self.batch = batch

    def __enter__(self) -> None:
        self.saved = (
            getattr(_current, "scope", None),
            getattr(_current, "why_not", None),
            getattr(_current, "batch", None),
        )
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
    return no_sample_rng(_NO_SAMPLE_RNG_IN_DEVICE_FN, BatchScope(seed, epoch, seq, _DEVICE_KEY))


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
        batch.rng = _generator(batch.seed, batch.key, batch.epoch, batch.first)
    return batch.rng
