"""The groups of ``Loader``'s arguments that every layer may read: frozen, and checked as they are made.

``Loader(source, fn, **kwargs)`` keeps its flat keyword arguments; ``_consumer/config.py`` sorts them
into groups, one frozen slotted dataclass per concern, and composes them into a
``LoaderConfig`` (``loader.config``). Each group checks its own fields in ``__post_init__`` (the
one place each argument is checked), so a group that exists is valid; the rules that span
two groups are checked once more by ``LoaderConfig``. The internals take the group they need
instead of copies of its fields: the worker spec takes ``Stages``, the engine ``Faults``.

This module holds the groups whose checks need nothing above ``_core`` (``Execution``, whose
``workers`` may be an ``AutoWorkers`` of the engine, is in ``_consumer/config.py``). The messages
are the ones ``Loader`` has always raised: each names the argument, what it must be, and
the value it got.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from .checks import check_int, is_count
from .rng import seeding_mode
from .shm import check_private_dir

CACHE_IN_MEMORY = "memory"  # cache="memory": the same as cache=True


class Group:
    """What every group shares: a readable ``repr`` (functions by name, not by address)."""

    __slots__ = ()

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={show(getattr(self, f.name))}" for f in fields(self))  # type: ignore[arg-type]
        return f"{type(self).__name__}({shown})"


def show(value: Any) -> str:
    """``value`` as a config's ``repr`` prints it: a function or class by its qualified name."""
    if inspect.isfunction(value) or inspect.ismethod(value) or inspect.isbuiltin(value) or inspect.isclass(value):
        module = getattr(value, "__module__", None)
        name = value.__qualname__
        return name if module in (None, "__main__", "builtins") else f"{module}.{name}"
    return repr(value)


def check_callables(**values: Any) -> None:
    """Raise ``TypeError`` naming the first of ``values`` that is neither callable nor None."""
    for name, value in values.items():
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class Batching(Group):
    """Which samples each batch holds, in which order, over how many epochs (``Loader``'s
    ``batch_size``, ``shuffle``, ``seed``, ``drop_last``, ``reshuffle``, ``epochs``,
    ``with_epoch``, ``batches``, ``shard``, ``even_ranks``, ``shuffle_buffer``)."""

    batch_size: int | None = 32
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    reshuffle: bool = True
    epochs: int | None = 1
    with_epoch: bool = False
    batches: Callable[[int], Any] | None = None
    shard: tuple[int, int] | None = None
    even_ranks: bool = False
    shuffle_buffer: int | None = None

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1, allow_none=True)
        check_int("seed", self.seed, 0)
        shard = self.shard
        if self.batches is not None:
            if not callable(self.batches):
                raise TypeError(
                    f"batches must be a callable epoch -> list of index lists, got {type(self.batches).__name__}"
                )
            if self.shuffle or self.drop_last or shard is not None:
                raise ValueError(
                    "batches=... decides every epoch's batches itself: shuffle, drop_last and shard do not apply "
                    "(leave them at their defaults and shuffle, drop or shard inside the callable)"
                )
        if shard is not None:
            if not (
                isinstance(shard, (tuple, list))
                and len(shard) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) for v in shard)
                and shard[1] >= 1
                and 0 <= shard[0] < shard[1]
            ):
                raise ValueError(f"shard must be (rank, world_size) with 0 <= rank < world_size, got {shard!r}")
            object.__setattr__(self, "shard", (shard[0], shard[1]))  # a list is accepted, kept as a pair
        if self.epochs is not None and not is_count(self.epochs, 1):
            raise ValueError(f"epochs must be an int >= 1 or None (endless), got {self.epochs!r}")
        for name in ("reshuffle", "with_epoch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.batches is not None and not self.reshuffle:
            raise ValueError(
                "batches=... decides every epoch's batches itself: reshuffle does not apply "
                "(return the same batches for every epoch from the callable instead)"
            )
        if not isinstance(self.even_ranks, bool):
            raise TypeError(f"even_ranks must be True or False, got {self.even_ranks!r}")
        if self.even_ranks and shard is None:
            raise ValueError(
                "even_ranks=True evens out the batches of the ranks of shard=(rank, world_size), but this "
                "Loader has no shard=; pass shard=(rank, world_size), or leave even_ranks out"
            )
        check_int("shuffle_buffer", self.shuffle_buffer, 1, allow_none=True)


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class Stages(Group):
    """What runs on each sample and batch, in the workers (``fn``, ``collate_fn``, ``batch_fn``,
    ``augment``, ``cache``, ``seed_globals``); the worker spec is made from it."""

    fn: Callable[[Any], Any] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    batch_fn: Callable[[Any], Any] | None = None
    augment: Callable[[Any], Any] | None = None
    cache: Any = None
    seed_globals: bool | str = True

    def __post_init__(self) -> None:
        check_callables(batch_fn=self.batch_fn, augment=self.augment)
        check_cache(self.cache)
        check_callables(fn=self.fn, collate_fn=self.collate_fn)
        seeding_mode(self.seed_globals)

    @property
    def seeding(self) -> str | None:
        """``seed_globals`` as a mode: ``"task"``, ``"sample"`` or None (``_core/rng.py``)."""
        return seeding_mode(self.seed_globals)


def check_cache(cache: Any) -> None:
    """``cache=``: None, a bool, ``"memory"``, or a writable directory only procpipe's user may write to."""
    if cache is None or isinstance(cache, bool) or cache == CACHE_IN_MEMORY:
        return
    if not isinstance(cache, (str, os.PathLike)):
        raise TypeError(f"cache must be None, False, True, 'memory' or a directory path, got {type(cache).__name__}")
    path = os.fspath(cache)
    if not os.path.isdir(path) or not os.access(path, os.W_OK):
        raise ValueError(
            f"cache={path!r} is not a writable directory: pass an existing directory for the cache "
            "file (memory-mapped), or cache=True to keep the cache in shared memory"
        )
    check_private_dir(path, "cache")


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class Memory(Group):
    """Where the shared-memory files go and how large the ring is (``shm_dir``, ``slot_bytes``,
    ``stage_slots``)."""

    shm_dir: str = "/dev/shm"
    slot_bytes: int | None = None
    stage_slots: int = 0

    def __post_init__(self) -> None:
        check_int("slot_bytes", self.slot_bytes, 1, allow_none=True)
        shm_dir = self.shm_dir
        if not os.path.isdir(shm_dir) or not os.access(shm_dir, os.W_OK):
            raise ValueError(
                f"shm_dir={shm_dir!r} is not a writable directory; pass a directory procpipe can create files in"
            )
        check_private_dir(shm_dir, "shm_dir")
        check_int("stage_slots", self.stage_slots, 0)


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class Faults(Group):
    """What a failure becomes (``on_error``, ``max_skipped``, ``task_timeout``, ``speculate``,
    ``max_worker_restarts``); the engine takes this group as it is."""

    on_error: str = "raise"
    max_skipped: int | float = 0.01
    task_timeout: float | None = None
    speculate: float | None = None
    max_worker_restarts: int = 3

    def __post_init__(self) -> None:
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        max_skipped = self.max_skipped
        if isinstance(max_skipped, bool) or not (
            (isinstance(max_skipped, int) and max_skipped >= 0)
            or (isinstance(max_skipped, float) and 0.0 <= max_skipped <= 1.0)
        ):
            raise ValueError(
                f"max_skipped must be an int >= 0 (a count) or a float in [0, 1] (a fraction of the "
                f"epoch's samples), got {max_skipped!r}"
            )
        if self.task_timeout is not None and not (is_number(self.task_timeout) and self.task_timeout > 0):
            raise ValueError(f"task_timeout must be None or a number of seconds > 0, got {self.task_timeout!r}")
        if self.speculate is not None and not (is_number(self.speculate) and self.speculate >= 1):
            raise ValueError(
                f"speculate must be None or a number >= 1 (a multiple of the median batch time), got {self.speculate!r}"
            )
        check_int("max_worker_restarts", self.max_worker_restarts, 0)

    @property
    def skip(self) -> bool:
        """``on_error="skip"``: a failing sample is left out of its batch."""
        return self.on_error == "skip"


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class Device(Group):
    """Where batches go once loaded (``device``, ``device_fn``). Which devices exist is checked
    by the device stage, which imports torch (``torch/device.py``)."""

    device: Any = None
    device_fn: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        check_callables(device_fn=self.device_fn)
        if self.device_fn is not None and self.device is None:
            raise ValueError(
                "device_fn runs on batches once they are on a device: pass device='cuda' (or 'cpu') "
                "with it, or transform batches in batch_fn (in the workers) instead"
            )
