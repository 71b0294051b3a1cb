"""``loader.config``: every argument of a ``Loader`` in one frozen, validated object, and its slices.

``Loader(source, fn, **kwargs)`` keeps its flat keyword arguments (the user API); its first
step is ``LoaderConfig.from_arguments``, which sorts them into six groups by name:

==============  ===================================================================
``batching``    batch_size, shuffle, seed, drop_last, reshuffle, epochs, with_epoch,
                batches, shard, even_ranks, shuffle_buffer
``stages``      fn, collate_fn, batch_fn, augment, cache, seed_globals
``execution``   workers, ordered, prefetch, start_method, worker_env, backend
``memory``      shm_dir, slot_bytes, stage_slots
``faults``      on_error, max_skipped, task_timeout, speculate, max_worker_restarts
``device``      device, device_fn
==============  ===================================================================

Each group is a frozen slotted dataclass that checks its own fields when it is made
(``__post_init__``: ``_core/config.py``, and ``Execution`` here); ``LoaderConfig`` then checks
the rules that span groups (``check_across``), once. The checks that involve the source
itself (its kind, a ``Mix`` with ``batches=``) are ``kinds.py``'s (``resolve_kind``). Nothing is checked
anywhere else, and nothing per batch: the internals are handed the slice they need
(``engine_config``: the engine's; ``WorkerSpec.of``: the workers'), built once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, cast

from .._core.checks import check_int
from .._core.config import Batching, Device, Faults, Group, Memory, Stages
from .._engine.autotune import AutoWorkers
from .._engine.autotune import resolve as resolve_autotune
from .._engine.config import EngineConfig
from .._worker.start_method import START_METHODS

#: set in every worker unless ``worker_env`` says otherwise: one thread per math library
DEFAULT_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@dataclass(frozen=True, slots=True, kw_only=True, repr=False)
class Execution(Group):
    """How and where the work runs (``workers``, ``ordered``, ``prefetch``, ``start_method``,
    ``worker_env``, ``backend``), as passed to ``Loader``.

    ``autotune`` is the ``AutoWorkers`` of ``workers="auto"``; ``environment()`` the variables
    set in each worker (one thread per math library, then ``worker_env``).
    """

    # (here, not in _core/config.py with the other groups: workers= may be the engine's AutoWorkers)

    workers: int | str | AutoWorkers = 2
    ordered: bool = True
    prefetch: int = 2
    start_method: str = "auto"
    worker_env: Mapping[str, str] | None = None
    backend: Any = None

    def __post_init__(self) -> None:
        workers = self.workers
        if resolve_autotune(workers) is None:
            if isinstance(workers, str):
                raise ValueError(f"workers must be an int >= 0 or 'auto', got {workers!r}")
            check_int("workers", workers, 0)
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
