"""A ``Loader``'s whole configuration, in one module: every argument in a frozen group, checked as it is made.

``Loader(source, fn, **kwargs)`` keeps its flat keyword arguments (the user API); its first
step is ``LoaderConfig.from_arguments``, which sorts them into six groups by name:

==============  ===================================================================
``batching``    batch_size, shuffle, seed, drop_last, reshuffle, epochs, with_epoch,
                batches, shard, even_ranks, shuffle_buffer
``stages``      fn, collate_fn, batch_fn, augment, cache, seed_globals
``execution``   workers, ordered, prefetch, start_method, worker_env, backend, assign
``memory``      shm_dir, slot_bytes, stage_slots
``faults``      on_error, max_skipped, task_timeout, speculate, max_worker_restarts
``device``      device, device_fn
==============  ===================================================================

Each group is a frozen slotted dataclass that checks its own fields in ``__post_init__`` (the
one place each argument is checked), so a group that exists is valid; ``LoaderConfig`` then
checks the rules that span groups (``check_across``), once. The checks that involve the source
itself (its kind, a ``Mix`` with ``batches=``) are ``_sources/resolve.py``'s (``resolve_kind``).
Nothing is checked anywhere else, and nothing per batch: the internals are handed the slice
they need, built once: the workers take ``Stages`` (``WorkerSpec.of``), the engine its
``EngineConfig`` (``engine_config``: workers, ring, ``Faults``). ``AutoWorkers`` is the option
object of ``workers="auto"``; the tuner that follows it is ``_engine/autotune.py``.

Every layer may read this module: it imports nothing of procpipe but ``_core``. The messages
name the cause and the fix: each names the argument, what it must be, and the
value it got.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, cast

from ._core.checks import check_int, is_count
from ._core.cpus import cpu_budget
from ._core.rng import seeding_mode
from ._core.shm import check_private_dir

#: ``Loader(start_method=...)``: the start methods procpipe knows ("auto" is resolved by ``_worker/start_method.py``)
START_METHODS = ("auto", "forkserver", "spawn", "fork", "zygote")
IO_FACTOR = 4  # AutoWorkers' default max: this many workers per CPU (reached only when I/O-bound)
HARD_CAP = 128  # ...and never more than this by default (a 96-CPU node: 96 CPU-bound workers)

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
    """Where the ring lives and how large it is (``shm_dir``: None, anonymous shared memory, or a
    directory for its files; ``slot_bytes``, ``stage_slots``)."""

    shm_dir: str | None = None
    slot_bytes: int | None = None
    stage_slots: int = 0

    def __post_init__(self) -> None:
        check_int("slot_bytes", self.slot_bytes, 1, allow_none=True)
        check_int("stage_slots", self.stage_slots, 0)
        shm_dir = self.shm_dir
        if shm_dir is None:
            return
        if not isinstance(shm_dir, (str, os.PathLike)):
            raise TypeError(f"shm_dir must be None or a directory path, got {type(shm_dir).__name__}")
        shm_dir = os.fspath(shm_dir)
        object.__setattr__(self, "shm_dir", shm_dir)  # (a path-like, kept as the str every module uses)
        if not os.path.isdir(shm_dir) or not os.access(shm_dir, os.W_OK):
            raise ValueError(
                f"shm_dir={shm_dir!r} is not a writable directory; pass a directory procpipe can create files in"
            )
        check_private_dir(shm_dir, "shm_dir")


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


@dataclass(frozen=True)
class AutoWorkers:
    """Settings of ``Loader(workers=AutoWorkers(...))``; ``workers="auto"`` is ``AutoWorkers()``.

    Args:
        start: workers to begin with (default 2; fewer if the limit is lower).
        min: never fewer workers than this (>= 1).
        max: never more; default ``4 x`` the CPUs this process may use (affinity and cgroup
            quota, ``_core/cpus.py``; at most 128).
            Counts above the CPU count are used only while workers are I/O-bound.
        interval: seconds per control interval, at least (default 0.25).
        min_batches: batches the consumer must take in an interval before it is judged
            (default 16), so that slow pipelines are judged on enough batches.
    """

    start: int = 2
    min: int = 1
    max: int | None = None
    interval: float = 0.25
    min_batches: int = 16

    def __post_init__(self) -> None:
        for name in ("start", "min", "min_batches"):
            check_int(name, getattr(self, name), 1, owner="AutoWorkers: ")
        check_int("max", self.max, self.min, allow_none=True, owner="AutoWorkers: ")
        if isinstance(self.interval, bool) or not isinstance(self.interval, (int, float)) or not self.interval > 0:
            raise ValueError(f"AutoWorkers: interval must be a number of seconds > 0, got {self.interval!r}")

    @property
    def hard_max(self) -> int:
        """The most workers this may ever run (the status words and the ring are sized for it)."""
        if self.max is not None:
            return self.max
        return max(self.min, min(HARD_CAP, IO_FACTOR * cpu_count()))

    @property
    def first(self) -> int:
        """Workers to start with: ``start``, within ``[min, CPUs]`` and ``max``."""
        return max(self.min, min(self.start, self.hard_max, max(cpu_count(), self.min)))


def resolve_autotune(workers: Any) -> AutoWorkers | None:
    """``"auto"`` -> ``AutoWorkers()``; an ``AutoWorkers`` as is; anything else None."""
    if isinstance(workers, AutoWorkers):
        return workers
    if isinstance(workers, str) and workers == "auto":
        return AutoWorkers()
    return None


def cpu_count() -> int:
    """The CPUs this process may really use: its affinity and its cgroup's quota (``_core/cpus.py``)."""
    return cpu_budget()


#: ``Loader(assign=...)``: each batch to the least busy worker, or batch k to worker k % workers
ASSIGN_MODES = ("balanced", "round_robin")

#: set in every worker unless ``worker_env`` says otherwise: one thread per math library
DEFAULT_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class Execution(Group):
    """How and where the work runs (``workers``, ``ordered``, ``prefetch``, ``start_method``,
    ``worker_env``, ``backend``, ``assign``), as passed to ``Loader``.

    ``autotune`` is the ``AutoWorkers`` of ``workers="auto"``; ``environment()`` the variables
    set in each worker (one thread per math library, then ``worker_env``).
    """

    workers: int | str | AutoWorkers = 2
    ordered: bool = True
    prefetch: int = 2
    start_method: str = "auto"
    worker_env: Mapping[str, str] | None = None
    backend: Any = None
    assign: str = "balanced"

    def __post_init__(self) -> None:
        workers = self.workers
        if resolve_autotune(workers) is None:
            if isinstance(workers, str):
                raise ValueError(f"workers must be an int >= 0 or 'auto', got {workers!r}")
            check_int("workers", workers, 0)
        self.check_assign()
        check_int("prefetch", self.prefetch, 1)
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {self.start_method!r}")
        env = self.worker_env
        if env is not None:
            if not (
                isinstance(env, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
            ):
                raise TypeError(
                    f"worker_env must be a dict of environment variable names to str values, or None; got {env!r} "
                    '(write numbers as strings: {"OMP_NUM_THREADS": "2"})'
                )
            object.__setattr__(self, "worker_env", dict(env))  # a copy: the caller's dict may change later
        self.check_backend()

    def check_backend(self) -> None:
        """``backend``: None, or a remote backend (``procpipe.ray.Backend``) with a fixed worker count."""
        backend, workers = self.backend, self.workers
        if backend is None:
            return
        if not (callable(getattr(backend, "pool", None)) and callable(getattr(backend, "lanes", None))):
            raise TypeError(f"backend must be None or a procpipe.ray.Backend(...), got {backend!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(
                f"with backend={type(backend).__name__}(...), workers is the number of worker processes per "
                f"node and must be an int >= 1 (workers=0 and workers='auto' run on this machine), got "
                f"{workers!r}"
            )

    def check_assign(self) -> None:
        """``assign``: ``"balanced"`` or ``"round_robin"``, the latter over a fixed worker count."""
        if self.assign not in ASSIGN_MODES:
            raise ValueError(f"assign must be one of {ASSIGN_MODES}, got {self.assign!r}")
        if self.assign == "round_robin" and (self.autotune is not None or self.backend is not None):
            raise ValueError(
                "assign='round_robin' sends batch k to worker k % workers, so it needs a fixed number of "
                "local workers: pass workers=N (an int), not workers='auto' or a backend, or use "
                "assign='balanced'"
            )

    @property
    def rotation(self) -> int:
        """Workers the batches of an epoch rotate over (``assign="round_robin"``); 0: any worker."""
        if self.assign != "round_robin" or not isinstance(self.workers, int):
            return 0
        return self.workers

    @property
    def autotune(self) -> AutoWorkers | None:
        """The ``AutoWorkers`` of ``workers="auto"`` (or the one given), else None."""
        return resolve_autotune(self.workers)

    @property
    def has_workers(self) -> bool:
        """Worker processes load the batches (False: ``workers=0``, everything runs in ``next()``)."""
        return self.autotune is not None or self.workers != 0

    def environment(self) -> dict[str, str]:
        """The environment set in each worker: ``DEFAULT_WORKER_ENV``, updated by ``worker_env``."""
        return {**DEFAULT_WORKER_ENV, **(self.worker_env or {})}


@dataclass(frozen=True, slots=True)
class LoaderConfig:
    """A ``Loader``'s whole configuration (``loader.config``): its arguments but ``source``, in six
    frozen groups, each checked as it was made, then checked across groups (``check_across``).

    ``repr()`` prints one group per line. Read it (``loader.config.batching.batch_size``); to
    change a setting, create a new ``Loader``.
    """

    batching: Batching = field(default_factory=Batching)
    stages: Stages = field(default_factory=Stages)
    execution: Execution = field(default_factory=Execution)
    memory: Memory = field(default_factory=Memory)
    faults: Faults = field(default_factory=Faults)
    device: Device = field(default_factory=Device)

    #: the order the groups are made in by ``from_arguments``: the order ``Loader`` always checked in
    CHECK_ORDER: ClassVar[tuple[str, ...]] = ("faults", "stages", "device", "batching", "execution", "memory")

    def __post_init__(self) -> None:
        check_across(self)

    def __repr__(self) -> str:
        lines = "".join(f"    {f.name}={getattr(self, f.name)!r},\n" for f in fields(self))
        return f"{type(self).__name__}(\n{lines})"

    @classmethod
    def from_arguments(cls, **arguments: Any) -> LoaderConfig:
        """The configuration of ``Loader(source, **arguments)``: each argument goes to the group
        with a field of its name; an argument left out keeps that field's default."""
        per_group: dict[str, dict[str, Any]] = {name: {} for name in cls.CHECK_ORDER}
        for name, value in arguments.items():
            group = ARGUMENT_GROUPS.get(name)
            if group is None:
                raise TypeError(f"Loader() got an unexpected keyword argument {name!r}")
            per_group[group][name] = value
        return cls(**{name: GROUP_TYPES[name](**per_group[name]) for name in cls.CHECK_ORDER})


def check_across(config: LoaderConfig) -> None:
    """The rules that span two groups (each group has checked its own fields already)."""
    unbatched = config.batching.batch_size is None
    if config.stages.batch_fn is not None and unbatched:
        raise ValueError(
            "batch_fn needs a batch_size: with batch_size=None samples are yielded unbatched "
            "(apply the function in fn or augment instead)"
        )
    if config.stages.collate_fn is not None and unbatched:
        raise ValueError("collate_fn needs a batch_size: with batch_size=None samples are yielded unbatched")


#: each group of ``LoaderConfig`` -> its type
GROUP_TYPES: dict[str, Any] = {  # (each a dataclass, a subclass of Group)
    "batching": Batching,
    "stages": Stages,
    "execution": Execution,
    "memory": Memory,
    "faults": Faults,
    "device": Device,
}
#: argument name -> the group holding it (no two groups have a field of the same name)
ARGUMENT_GROUPS: dict[str, str] = {f.name: group for group, kind in GROUP_TYPES.items() for f in fields(kind)}


def engine_config(config: LoaderConfig, start_method: str, device_slots: int = 0) -> EngineConfig:
    """The engine's slice of ``config``: the workers to start (``workers="auto"``: the tuner's
    first count; a backend: every node's), the ``start_method`` as resolved, the workers'
    environment, the ring's settings (``device_slots``: the device stage's own) and ``faults``."""
    execution = config.execution
    auto = execution.autotune
    workers = cast(int, execution.workers) if auto is None else auto.first  # (an int unless autotuned)
    if execution.backend is not None:  # workers= is per node: the coordinator sees them all
        workers = execution.backend.lanes(execution.workers)
    return EngineConfig(
        workers=workers,
        start_method=start_method,
        worker_env=execution.environment(),
        prefetch=execution.prefetch,
        slot_bytes=config.memory.slot_bytes,
        stage_slots=config.memory.stage_slots + device_slots,
        autotune=auto,
        faults=config.faults,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """What the coordinator and its pool need from the Loader's configuration.

    Args:
        workers: workers to start (with ``autotune``: the count to begin with).
        start_method: ``"fork"``, ``"zygote"``, ``"forkserver"`` or ``"spawn"`` (never ``"auto"``).
        worker_env: the environment variables set in each worker (the defaults and ``worker_env=``).
        prefetch: ready batches kept ahead of the consumer (ring slots for them).
        slot_bytes: the ring's slot size, or None to size it from the first batch.
        stage_slots: ring slots the consumer's stages may hold (``stage_slots=`` and a device stage's).
        autotune: the ``AutoWorkers`` of ``workers="auto"``, else None.
        faults: the ``Faults`` group (``on_error``, ``max_skipped``, ``task_timeout``, ``speculate``,
            ``max_worker_restarts``).
    """

    workers: int
    start_method: str
    worker_env: dict[str, str] = field(default_factory=dict)
    prefetch: int = 2
    slot_bytes: int | None = None
    stage_slots: int = 0
    autotune: AutoWorkers | None = None
    faults: Faults = field(default_factory=Faults)
