"""``procpipe.Loader``: the public entry point.

The Loader validates its arguments, ships the user's objects to the workers once, and
hands each epoch to the coordinator. Iterating it once is one epoch; workers persist
between epochs. With ``workers=0`` everything runs in the calling process through the
same sampler, sample scope and collation, so results are identical.
"""
from __future__ import annotations

import itertools
import os
import queue
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import multiprocess

from . import collate
from .coordinator import Coordinator, EndOfEpoch, EngineConfig, Epoch, Failure
from .errors import RemoteTraceback
from .rng import SampleScope
from .sampler import Sampler
from .shm import SharedFiles, check_capacity, create_file
from .stats import EpochCounters
from .worker import WorkerSpec, dump_spec

START_METHODS = ("forkserver", "spawn", "fork")
DEFAULT_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
_generations = itertools.count()
_CONSUMER_POLL_S = 1.0  # how often a waiting consumer checks that the coordinator is alive


class Loader:
    """Loads batches from ``source`` with worker processes, through a shared-memory ring.

    Args:
        source: any object with ``__len__`` and ``__getitem__(int)``.
        fn: optional per-sample function, ``fn(source[i]) -> sample``; runs in the workers.
        batch_size: samples per batch; ``None`` yields single samples, unbatched.
        workers: worker processes; ``0`` runs everything in the calling process.
        ordered: ``True`` yields batches in sampler order; ``False`` yields them as they
            finish ("sloppy"), so a slow batch does not hold back the others.
        prefetch: ready batches kept ahead of the consumer.
        shuffle, seed: the order of each epoch is a permutation drawn from ``(seed, epoch)``.
        drop_last: drop the last batch if it is smaller than ``batch_size``.
        collate_fn: optional ``collate_fn(list_of_samples) -> batch``, run in the worker,
            replacing the default stacking (e.g. to pad variable-length samples).
        start_method: ``"forkserver"`` (default, safe when the parent runs threads),
            ``"spawn"`` or ``"fork"``.
        shm_dir: directory of the shared-memory files (``/dev/shm`` by default).
        slot_bytes: size of a ring slot; by default the size of the first batch.
        max_worker_restarts: worker deaths tolerated per epoch before the epoch fails.
        worker_env: environment variables set in each worker (by default, one thread
            per math library).

    Use it as a context manager, or call ``close()``; an unclosed loader is cleaned up
    when it is garbage collected or when the interpreter exits.
    """

    def __init__(
        self,
        source: Any,
        fn: Callable[[Any], Any] | None = None,
        *,
        batch_size: int | None = 32,
        workers: int = 2,
        ordered: bool = True,
        prefetch: int = 2,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        collate_fn: Callable[[list], Any] | None = None,
        start_method: str = "forkserver",
        shm_dir: str = "/dev/shm",
        slot_bytes: int | None = None,
        max_worker_restarts: int = 3,
        worker_env: dict[str, str] | None = None,
    ) -> None:
        _validate(source, fn, batch_size, workers, prefetch, seed, collate_fn, start_method, shm_dir,
                  slot_bytes, max_worker_restarts)
        self._sampler = Sampler(len(source), batch_size, bool(shuffle), int(seed), bool(drop_last))
        self._spec = WorkerSpec(source, fn, collate_fn, batch_size is not None, int(seed))
        self._workers = workers
        self._ordered = bool(ordered)
        self._epoch = 0
        self._active: _EpochIterator | None = None
        self._last_counters: EpochCounters | None = None
        self._closed = False
        self._coordinator: Coordinator | None = None
        if workers > 0:
            env = dict(DEFAULT_WORKER_ENV)
            env.update(worker_env or {})
            config = EngineConfig(workers, self._ordered, prefetch, slot_bytes, max_worker_restarts, env, start_method)
            files = SharedFiles(shm_dir)
            try:
                ctx = _context(start_method, env)
                shipped = self._spec if start_method == "fork" else _ship_spec(self._spec, files)
                self._coordinator = Coordinator(config, ctx, shipped, files)
            except BaseException:
                files.remove_all()
                raise
        self._finalizer = weakref.finalize(self, _close_engine, self._coordinator)

    # ------------------------------------------------------------------ public API
    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._sampler)

    def __iter__(self) -> Iterator[Any]:
        """Start the next epoch (ending an unfinished previous one) and iterate over it."""
        if self._closed:
            raise RuntimeError("this procpipe.Loader is closed; create a new one to load more data")
        if self._active is not None:
            self._active.cancel("a new iteration over the loader started")
        epoch = self._epoch
        self._epoch += 1
        if self._coordinator is None:
            it: _EpochIterator = _InlineIterator(self, epoch)
        else:
            it = _EpochIterator(self, epoch)
        self._active = it
        return it

    @property
    def epoch(self) -> int:
        """The epoch number the next ``iter(loader)`` will produce."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch number of the next iteration (its shuffle order and sample seeds)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._epoch = epoch

    def close(self) -> None:
        """End every worker and remove every shared-memory file. Safe to call twice.

        Batches already delivered stay valid: their memory is freed when the last array
        of each is dropped.
        """
        if self._active is not None:
            self._active.cancel("the loader was closed")
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (empty for ``workers=0`` or once closed)."""
        if self._coordinator is None or self._closed:
            return []
        return [w.process.pid for w in self._coordinator.workers]

    @property
    def shm_prefix(self) -> str | None:
        """Path prefix of every shared-memory file this loader creates."""
        return None if self._coordinator is None else self._coordinator.files.prefix


def _close_engine(coordinator: Coordinator | None) -> None:
    if coordinator is not None:
        coordinator.close()


class _EpochIterator:
    """One epoch from the workers: reads the epoch's queue, filled by the coordinator."""

    def __init__(self, loader: Loader, number: int) -> None:
        self._loader = loader
        self._coordinator = loader._coordinator
        self._epoch = Epoch(next(_generations), number, loader._sampler.batches(number), loader._ordered)
        self._done = False
        self._cancelled: str | None = None
        loader._last_counters = self._epoch.counters
        self._coordinator.submit("start", self._epoch)

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            if self._cancelled:
                raise RuntimeError(f"this epoch's iterator was ended early: {self._cancelled}")
            raise StopIteration
        epoch = self._epoch
        started = time.perf_counter()
        item = self._get()
        epoch.counters.wait_s += time.perf_counter() - started
        if item is EndOfEpoch:
            self._done = True
            raise StopIteration
        if isinstance(item, Failure):
            self._done = True
            raise item.exc
        self._coordinator.consumed_one(epoch)
        return item

    def _get(self) -> Any:
        out = self._epoch.out
        while True:
            try:
                return out.get(timeout=_CONSUMER_POLL_S)
            except queue.Empty:
                if not self._coordinator.is_alive():
                    return Failure(RuntimeError("procpipe's coordinator thread has stopped; the loader was closed"))

    def cancel(self, why: str) -> None:
        if not self._done:
            self._done = True
            self._cancelled = why
            self._coordinator.submit("cancel", self._epoch.gen)

    def __del__(self) -> None:
        if not self._done and self._coordinator is not None:
            self._coordinator.submit("cancel", self._epoch.gen)


class _InlineIterator(_EpochIterator):
    """``workers=0``: the same sampler, sample scope and collation, in the calling process."""

    def __init__(self, loader: Loader, number: int) -> None:
        self._loader = loader
        self._coordinator = None
        self._number = number
        self._batches = iter(loader._sampler.batches(number))
        self._scope = SampleScope(loader._spec.seed)
        self._done = False
        self._cancelled = None
        self._counters = loader._last_counters = EpochCounters(epoch=number)

    def __next__(self) -> Any:
        if self._done:
            return super().__next__()
        indices = next(self._batches, None)
        if indices is None:
            self._done = True
            self._counters.ended = time.perf_counter()
            raise StopIteration
        spec, index = self._loader._spec, None
        try:
            samples = []
            for index in indices:
                self._scope.enter(self._number, index)
                sample = spec.source[index]
                samples.append(sample if spec.fn is None else spec.fn(sample))
            self._scope.leave()
            index = None
            if not spec.batched:
                layout = collate.layout_value(samples[0], None, 0)[0]
            elif spec.collate_fn is not None:
                layout = collate.layout_value(spec.collate_fn(samples), None, 0)[0]
            else:
                layout = collate.layout_batch(samples, indices, None, 0)[0]
        except Exception as exc:
            self._scope.leave()
            self._done = True
            where = f"while loading index {index}" if index is not None else f"while collating indices {indices}"
            exc.add_note(f"procpipe: raised in the calling process (workers=0) {where} (epoch {self._number}).")
            raise
        self._counters.batches += 1
        self._counters.samples += len(indices)
        return collate.build(layout, None)

    def cancel(self, why: str) -> None:
        self._done = True

    def __del__(self) -> None:
        pass


def _context(start_method: str, env: dict[str, str]) -> Any:
    """The multiprocess context; a forkserver preloads procpipe and the main module once."""
    ctx = multiprocess.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["__main__", "procpipe.worker"])
        # The forkserver process inherits the environment when it starts: start it with
        # the workers' settings so libraries it preloads (numpy's BLAS) see them.
        from multiprocess import forkserver

        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return ctx


def _ship_spec(spec: WorkerSpec, files: SharedFiles) -> str:
    """Pickle the dataset, fn and collate_fn once (dill), into a shared file every worker reads."""
    try:
        data = dump_spec(spec)
    except Exception as exc:
        raise TypeError(
            f"procpipe could not serialize the source, fn or collate_fn for the workers: {exc}. "
            "Everything passed to Loader must be picklable by dill; open files, locks and sockets "
            "should be opened lazily inside __getitem__ or fn instead. start_method='fork' avoids "
            "serialization altogether."
        ) from exc
    path = files.path("spec")
    check_capacity(files.directory, len(data), "the serialized dataset and functions")
    create_file(path, len(data), "the serialized dataset and functions")
    with open(path, "r+b") as f:
        f.write(data)
    return path


def _validate(source: Any, fn: Any, batch_size: Any, workers: Any, prefetch: Any, seed: Any, collate_fn: Any,
              start_method: Any, shm_dir: Any, slot_bytes: Any, max_worker_restarts: Any) -> None:
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise TypeError(
            f"source must support len() and indexing with an int (a list, a numpy array, a torch Dataset...); "
            f"got {type(source).__name__}, which lacks "
            f"{'__len__' if not hasattr(source, '__len__') else '__getitem__'}. Wrap iterables in a list first."
        )
    for name, value in (("fn", fn), ("collate_fn", collate_fn)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
    _check_int("batch_size", batch_size, 1, allow_none=True)
    _check_int("workers", workers, 0)
    _check_int("prefetch", prefetch, 1)
    _check_int("seed", seed, 0)
    _check_int("slot_bytes", slot_bytes, 1, allow_none=True)
    _check_int("max_worker_restarts", max_worker_restarts, 0)
    if collate_fn is not None and batch_size is None:
        raise ValueError("collate_fn needs a batch_size: with batch_size=None samples are yielded unbatched")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    if not os.path.isdir(shm_dir) or not os.access(shm_dir, os.W_OK):
        raise ValueError(f"shm_dir={shm_dir!r} is not a writable directory; pass a directory procpipe can create files in")


def _check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an int >= {minimum}{extra}, got {value!r}")
