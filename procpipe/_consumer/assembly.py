"""A Loader's running parts, made from its checked configuration, and the figures they report.

``Loader.__init__`` is three steps: the configuration (``LoaderConfig.from_arguments``,
``config.py``: every argument checked), the source's kind (``resolve_kind``,
``_sources/resolve.py``: its plan of epochs, its workers' reader), then ``assemble`` (here), which
hands each part the slice of the configuration it needs:

- the device stage (``device=``: torch is imported only then, and the device is checked
  before any worker starts);
- the worker spec (``WorkerSpec.of``: the stage functions, the seed, the fault mode), and its
  cache (``with_cache``), opened in the loader's shared memory (``Segments``);
- the start method, resolved once (its restarted workers start the same way);
- the engine (``engine_config``: workers, ring, faults) with its workers, or with
  ``workers=0`` the cache in this process;
- the ``IterationContext`` every epoch iterator is given, and the finalizer that stops the
  engine when the Loader is closed or garbage (``LoaderParts.close``).

``LoaderParts.stats`` is ``Loader.stats()``: the epoch's counters, the workers', the ring's,
the tuner's, the backend's and the device stage's, read from these parts.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from .._core.shm import Segments
from .._core.stats import EpochCounters, snapshot
from .._engine.coordinator import Coordinator
from .._engine.pool import WorkerLink
from .._engine.start import start_engine
from .._sources.source_kind import SourceKind
from .._worker.cache import open_cache
from .._worker.fork_safety import why_not_safe
from .._worker.start_method import resolve as resolve_start_method
from .._worker.worker_spec import WorkerSpec
from ..config import LoaderConfig, engine_config
from ..errors import ShippingError
from .device_stages import DeviceStage, device_stage_factory
from .iteration_context import IterationContext, LoaderIterator
from .shutdown import close_engine, watch_exit


@dataclass(frozen=True, slots=True)
class LoaderParts:
    """What a Loader runs on: made once by ``assemble``."""

    device_stage: DeviceStage | None  # None without device=
    spec: WorkerSpec  # what the workers run (and this process, with workers=0)
    start_method: str  # resolved: never "auto"
    coordinator: Coordinator | None  # None with workers=0
    context: IterationContext
    finalizer: weakref.finalize[Any, Any]  # stops the engine once the context is garbage, or at close()

    def live_workers(self) -> list[WorkerLink]:
        """The workers running now (none with ``workers=0``)."""
        return [] if self.coordinator is None else list(self.coordinator.workers)

    def close(self) -> None:
        """Stop the device stage, the engine (every worker and shared file) and the cache."""
        if self.device_stage is not None:  # its CUDA registrations end before the ring is unmapped
            self.device_stage.close()
        self.finalizer()
        if self.spec.cache is not None:
            self.spec.cache.close()

    def stats(self, counters: EpochCounters | None, active: LoaderIterator | None, workers: Any) -> dict[str, Any]:
        """``Loader.stats()``: ``counters``, the epoch's; ``active``, the latest iteration's source
        node; ``workers``, the ``workers=`` setting (a count unless autotuned)."""
        running = active is not None and active.running
        coordinator = self.coordinator
        device = None if self.device_stage is None else self.device_stage.info()
        if coordinator is None:
            out = snapshot(counters, workers=0, running=running, consumed=None)
            out.update(autotune=None, backend=None, device=device)
            return out
        worker_counters = list(coordinator.worker_counters)
        pids: list[int | None] = [None] * len(worker_counters)
        for w in list(coordinator.workers):
            if w.index < len(pids):
                pids[w.index] = w.pid
        out = snapshot(
            counters,
            workers=coordinator.n_workers if coordinator.tuner is not None else workers,
            running=running,
            consumed=None if active is None else active.consumed,
            ring=coordinator.ring,
            worker_counters=worker_counters,
            pids=pids,
        )
        out.update(autotune=coordinator.autotune_info(), backend=coordinator.pool.info(), device=device)
        return out


def assemble(config: LoaderConfig, kind: SourceKind) -> LoaderParts:
    """The parts of a Loader over a source of ``kind`` (_sources/resolve.py: its plan of epochs, and
    the source and reader its workers use).

    The spec is made once (``WorkerSpec.of``), its cache opened once (``with_cache``) in the
    loader's shared memory; workers are started here; on failure nothing is left behind
    (``start_engine``).
    """
    device_stage = None if config.device.device is None else make_device_stage(config)
    spec = WorkerSpec.of(kind.source, kind.producer, config.stages, config.batching, config.faults)
    execution, memory, cache = config.execution, config.memory, config.stages.cache
    # once: its restarted workers start the same way (a slower start is said once, if workers start here)
    starts_here = execution.has_workers and execution.backend is None
    # (its warning points at the user's Loader(...) line: above this, Loader.__init__)
    start_method = resolve_start_method(execution.start_method, warn=starts_here, stacklevel=5)
    engine = None
    if execution.has_workers:
        engine = engine_config(config, start_method, 0 if device_stage is None else device_stage.slots_held)
    segments = Segments(memory.shm_dir)  # the loader's shared memory: its ring, and its cache unless in a directory
    if execution.backend is None:  # (a remote backend's agents each open their own cache, on their node)
        try:
            spec = spec.with_cache(open_cache(spec, cache, segments, workers=engine is not None))
        except BaseException:
            segments.remove_all()
            raise
    coordinator = None
    if engine is not None:
        try:
            coordinator = start_engine(engine, spec, cache, segments, execution.backend)
        except ShippingError as exc:
            why = why_not_safe() if execution.start_method == "auto" and start_method != "fork" else None
            if why is None:
                raise
            raise exc.reworded(why_not_forked=why) from None
    context = IterationContext(
        order=kind.order,
        spec=spec,
        ordered=bool(execution.ordered),
        with_epoch=config.batching.with_epoch,
        max_skipped=config.faults.max_skipped,
        coordinator=coordinator,
        epochs=config.batching.epochs,
        rotation=execution.rotation,
    )
    # The engine lives as long as the context, which nothing holding the Loader holds (no cycle)
    finalizer = weakref.finalize(context, close_engine, coordinator)
    watch_exit(finalizer)  # (after a finalize exists: see _consumer/shutdown.py)
    return LoaderParts(device_stage, spec, start_method, coordinator, context, finalizer)


def make_device_stage(config: LoaderConfig) -> DeviceStage:
    """``device=``'s stage: checked before any worker starts."""
    device = config.device
    make = device_stage_factory()  # the adapter's (torch), through the registry: _consumer/device_stages.py
    return make(device.device, config.execution.prefetch, device.device_fn, config.batching.seed)
