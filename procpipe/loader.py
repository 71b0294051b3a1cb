"""``procpipe.Loader``: the public entry point.

The Loader validates its arguments, ships the user's objects to the workers once, and
hands each iteration to the coordinator. Iterating it once is one epoch (or ``epochs=N``
epochs, or an endless stream with ``epochs=None``); workers persist between iterations. With ``workers=0`` everything runs in the calling process through the
same sampler, sample scope and collation, so results are identical.
"""
from __future__ import annotations

import itertools
import os
import queue
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import multiprocess

from . import collate
from .cache import open_cache
from .cache import validate as validate_cache
from .autotune import resolve as resolve_autotune
from .coordinator import Coordinator, EngineConfig
from .epochs import EndOfEpoch, Epoch, EpochEnd, Failure, Stream, iteration_over
from .faults import SkipBudget
from .reassembly import Progress
from .produce import produce
from .rng import SampleScope
from .sampler import ExplicitBatches, Sampler
from .shm import SharedFiles, check_capacity, create_file
from .streaming import InlineStream, Shards, StreamPlan
from .stats import EpochCounters, array_bytes
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
        workers: worker processes; ``0`` runs everything in the calling process;
            ``"auto"`` (or a ``procpipe.AutoWorkers(...)``) starts with 2 and adds or
            retires workers while running, until the consumer no longer waits or more
            workers stop helping (bounded by CPUs, or more when workers wait on I/O,
            and by memory); ``stats()["autotune"]`` shows its trace. See docs_epochs.md.
        ordered: ``True`` yields batches in sampler order; ``False`` yields them as they
            finish ("sloppy"), so a slow batch does not hold back the others.
        prefetch: ready batches kept ahead of the consumer.
        shuffle, seed: the order of each epoch is a permutation drawn from ``(seed, epoch)``.
        drop_last: drop the last batch if it is smaller than ``batch_size``.
        reshuffle: with ``shuffle=True``, ``False`` keeps one order: every epoch uses epoch
            0's permutation (``sample_rng()`` still differs by epoch).
        epochs: epochs one ``iter(loader)`` spans: ``1`` (default), ``N``, or ``None`` for
            an endless stream. Workers go on across epoch boundaries (the next epoch's
            batches are dispatched while the last ones of this epoch still run); ordered
            delivery is by (epoch, position).
        with_epoch: yield ``(epoch, batch)`` pairs instead of batches.
        collate_fn: optional ``collate_fn(list_of_samples) -> batch``, run in the worker,
            replacing the default stacking (e.g. to pad variable-length samples).
        start_method: ``"forkserver"`` (default, safe when the parent runs threads),
            ``"spawn"`` or ``"fork"``.
        shm_dir: directory of the shared-memory files (``/dev/shm`` by default).
        slot_bytes: size of a ring slot; by default the size of the first batch.
        max_worker_restarts: worker deaths tolerated per epoch before the epoch fails.
        worker_env: environment variables set in each worker (by default, one thread
            per math library).
        batches: optional ``batches(epoch) -> list of index lists``, called once per epoch
            in the calling process, replacing the built-in order (``shuffle`` and
            ``drop_last`` must then stay off). Each inner list is one batch, any size;
            with ``batch_size=None`` every list must hold one index. A ``len()`` on the
            callable, if it has one, is the loader's ``len()``. ``procpipe.torch.DataLoader``
            uses it to follow a torch sampler.
        shard: ``(rank, world_size)`` for data-parallel training: each rank gets a disjoint,
            equal-length part of every epoch's order, like ``DistributedSampler``: the
            order is padded by repeating its first indices up to a multiple of
            ``world_size``, then rank ``r`` takes positions ``r, r + world_size, ...``.
            Use the same ``seed`` on every rank.
        device: ``None`` yields numpy batches; ``"cpu"`` yields torch tensors sharing memory
            with the ring; ``"cuda"``/``"cuda:N"`` yields tensors already on that device,
            copied by a background thread through pinned memory on its own CUDA stream.
            Needs torch (imported only when ``device`` is given); see ``procpipe.torch``.
        on_error: ``"raise"`` (default): an exception in ``fn``/``__getitem__``/``collate_fn``
            ends the epoch with that exception. ``"skip"``: a failing sample is left out of
            its batch (the batch is smaller); a batch whose collation fails is left out
            whole. Each skip is logged (logger ``"procpipe"``, with index and exception)
            and listed in ``stats()["skipped"]``.
        max_skipped: with ``on_error="skip"``, the most samples an epoch may skip: an int
            (a count) or a float (a fraction of the epoch's samples, rounded up); past
            it, the exception that overflowed is raised. Default 0.01 (1 %).
        task_timeout: seconds a batch may run on a worker; a worker stuck longer is killed
            and replaced and the batch re-run; a batch stuck on every attempt (2) raises
            ``TaskTimeoutError`` naming the sample. ``None`` (default): no limit.
        speculate: a batch running longer than ``speculate`` times the median batch time
            (and at least 20 ms) is also given to a healthy worker; the first result wins
            and no batch is delivered twice. ``None`` (default) disables it. Adds
            ``workers`` ring slots.
        batch_fn: optional ``batch_fn(batch) -> batch``, a vectorized function run in the
            worker on each collated batch (after the default stacking or ``collate_fn``),
            before the batch goes into the ring. ``procpipe.batch_rng()`` works inside it;
            ``sample_rng()`` does not. Needs a ``batch_size``. With a streaming source it
            runs on batches of one block's records (they never span blocks); not with
            ``shuffle_buffer``.
        cache: ``None``/``False`` (default): no cache. ``True`` or ``"memory"``: the output
            of the deterministic first stage (``source[i]``, then ``fn``) is kept per index
            in shared memory (``shm_dir``), computed once, and read back in later epochs;
            a directory path: the same in a memory-mapped file there (data larger than
            memory). The first sample is computed when the loader is created, to lay the
            cache out (typed arrays: every sample must match its structure, dtypes and
            shapes). The cache is removed with the loader. See ``docs_stages.md``.
        augment: optional ``augment(sample) -> sample``, run every epoch after ``fn`` (or
            on a copy of the cached sample); the place for random augmentation with
            ``sample_rng()`` when ``cache`` is on.
        shuffle_buffer: streaming sources (``procpipe.Shards``) only: shuffle records
            through a buffer of this many records in the calling process, like tf.data's
            ``shuffle(buffer_size)``; deterministic from ``(seed, epoch)`` with ``ordered=True``.
            See docs_streaming.md.

    Use it as a context manager, or call ``close()``; an unclosed loader is cleaned up
    when it is garbage collected or when the interpreter exits.
    """

    def __init__(
        self,
        source: Any,
        fn: Callable[[Any], Any] | None = None,
        *,
        batch_size: int | None = 32,
        workers: int | str | Any = 2,
        ordered: bool = True,
        prefetch: int = 2,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        reshuffle: bool = True,
        epochs: int | None = 1,
        with_epoch: bool = False,
        collate_fn: Callable[[list], Any] | None = None,
        start_method: str = "forkserver",
        shm_dir: str = "/dev/shm",
        slot_bytes: int | None = None,
        max_worker_restarts: int = 3,
        worker_env: dict[str, str] | None = None,
        batches: Callable[[int], Any] | None = None,
        shard: tuple[int, int] | None = None,
        device: Any = None,
        on_error: str = "raise",
        max_skipped: int | float = 0.01,
        task_timeout: float | None = None,
        speculate: float | None = None,
        batch_fn: Callable[[Any], Any] | None = None,
        cache: Any = None,
        augment: Callable[[Any], Any] | None = None,
        shuffle_buffer: int | None = None,
    ) -> None:
        _validate(source, fn, batch_size, workers, prefetch, seed, collate_fn, start_method, shm_dir,
                  slot_bytes, max_worker_restarts, batches=batches, shard=shard, shuffle=shuffle,
                  drop_last=drop_last, on_error=on_error, max_skipped=max_skipped,
                  task_timeout=task_timeout, speculate=speculate, batch_fn=batch_fn, cache=cache,
                  augment=augment)
        _validate_epochs(epochs, reshuffle, with_epoch, batches)
        auto = resolve_autotune(workers)
        if isinstance(source, Shards):  # a streaming source: procpipe.streaming plans its epochs
            self._sampler = StreamPlan(source, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                       reshuffle=reshuffle, shard=shard, collate_fn=collate_fn,
                                       shuffle_buffer=shuffle_buffer, on_error=on_error, speculate=speculate,
                                       batches=batches, batch_fn=batch_fn, cache=cache)
            source = self._sampler.source  # the copy that knows how to lay out blocks
        elif shuffle_buffer is not None:
            raise ValueError("shuffle_buffer applies to streaming sources (procpipe.Shards); an indexable "
                             "source is shuffled whole with shuffle=True")
        elif batches is None:
            self._sampler = Sampler(len(source), batch_size, bool(shuffle), int(seed), bool(drop_last),
                                    None if shard is None else tuple(shard), bool(reshuffle))
        else:
            self._sampler = ExplicitBatches(batches, len(source), batch_size is None)
        # Checked before any worker starts; imports torch only when a device is asked for.
        self._device_stage = None if device is None else _device_stage(device, prefetch)
        self._spec = WorkerSpec(source, fn, collate_fn, batch_size is not None, int(seed))
        self._spec.skip = on_error == "skip"
        self._spec.batch_fn, self._spec.augment = batch_fn, augment
        self._max_skipped = max_skipped
        self._resume: _Resume | None = None  # from load_state_dict
        self._workers = workers
        self._epochs = epochs
        self._with_epoch = bool(with_epoch)
        self._ordered = bool(ordered)
        self._epoch = 0
        self._active: _EpochIterator | None = None
        self._last_counters: EpochCounters | None = None
        self._closed = False
        self._coordinator: Coordinator | None = None
        if auto is not None or workers > 0:
            env = dict(DEFAULT_WORKER_ENV)
            env.update(worker_env or {})
            config = EngineConfig(workers if auto is None else auto.first, self._ordered, prefetch, slot_bytes,
                                  max_worker_restarts, env, start_method,
                                  on_error=on_error, max_skipped=max_skipped, task_timeout=task_timeout,
                                  speculate=speculate, autotune=auto)
            files = SharedFiles(shm_dir)
            try:
                ctx = _context(start_method, env, files)
                self._spec.cache = open_cache(self._spec, cache, files, shm_dir)  # runs the first sample here
                shipped = self._spec if start_method == "fork" else _ship_spec(self._spec, files)
                self._coordinator = Coordinator(config, ctx, shipped, files)
            except BaseException:
                files.remove_all()
                raise
        else:
            self._spec.cache = open_cache(self._spec, cache, None, shm_dir)
        self._finalizer = weakref.finalize(self, _close_engine, self._coordinator)

    # ------------------------------------------------------------------ public API
    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._sampler)

    def __iter__(self) -> Iterator[Any]:
        """Start the next epoch, or ``epochs`` epochs (ending an unfinished previous iteration), and iterate."""
        if self._closed:
            raise RuntimeError("this procpipe.Loader is closed; create a new one to load more data")
        if self._active is not None:
            self._active.cancel("a new iteration over the loader started")
        epoch = self._epoch
        self._epoch += 1
        resume, self._resume = self._resume, None
        done, ahead, until = frozenset(), {}, self._default_until(epoch)
        if resume is not None and resume.epoch == epoch:
            done, ahead = resume.done, resume.ahead
            if resume.until is not _LOADER_EPOCHS:
                until = resume.until
        if self._coordinator is None:
            inline = InlineStream if isinstance(self._sampler, StreamPlan) else _InlineIterator
            it: _EpochIterator = inline(self, epoch, done, until, ahead)
        else:
            it = _EpochIterator(self, epoch, done, until, ahead)
        self._active = it
        if self._device_stage is not None:
            return self._device_stage(it)
        return it

    @property
    def epoch(self) -> int:
        """The epoch number the next ``iter(loader)`` will start with (during an iteration over
        several epochs: the one after the epoch of the last batch returned)."""
        return self._epoch

    def _default_until(self, start: int) -> int | None:
        return None if self._epochs is None else start + self._epochs

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch number of the next iteration (its shuffle order and sample seeds)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands, to resume exactly there: a small JSON-serializable dict.

        Taken after some batches of an epoch were returned (``ordered`` or not), and
        loaded with ``load_state_dict`` into a loader over the same data (same length,
        ``batch_size``, ``shuffle``, ``seed``, ``drop_last``, ``shard``; any ``workers``),
        the next ``iter()`` yields exactly the batches of that epoch not returned yet, and
        later epochs are those of an uninterrupted run. Batches still in the prefetch
        queue were not returned, so they are loaded again. Keys: ``epoch`` (to resume),
        ``done_below`` (every batch position below it was returned), ``done`` (positions
        returned beyond that, out of order), ``until`` (the epoch the resumed iteration
        stops before, ``None``: never; with ``epochs=N`` the interrupted iteration's end),
        ``ahead`` (``[epoch, done_below, done]`` for later epochs of which batches were
        already returned: ``ordered=False`` across an epoch boundary), plus the sampler's
        settings, checked on load.

        For a streaming source (``procpipe.Shards``) what was returned is counted in
        records: ``stream`` replaces ``done_below``/``done`` (None, or the
        ``procpipe.streaming.StreamProgress`` state of the epoch: ``complete`` shards, the
        ordered interleave's ``cursor``, ``received`` record ranges), ``ahead`` entries are
        ``[epoch, stream]``, and the settings checked are ``shards`` (their number),
        ``batch_size``, ``shuffle``, ``seed``, ``drop_last``, ``shard``, ``reshuffle``,
        ``cycle_length``, ``block_length``, ``mode`` and ``shuffle_buffer``. Records
        returned are not returned again, the others are, once; with ``ordered=True`` (and
        no ``shuffle_buffer``) in the very order of the uninterrupted run.
        """
        epoch, done, ahead, until = self._position()
        if isinstance(self._sampler, StreamPlan):
            progress = {"stream": done, "ahead": [[n, p] for n, p in sorted(ahead.items())]}
        else:
            progress = {"done_below": done.below, "done": sorted(done.beyond),
                        "ahead": [[n, p.below, sorted(p.beyond)] for n, p in sorted(ahead.items())]}
        return {"version": 1, "epoch": epoch, **progress, "until": until, **_sampler_state(self._sampler)}

    def _position(self) -> tuple[int, Any, dict[int, Any], int | None]:
        """``(epoch, what was returned of it, of later epochs, until)``: what ``state_dict`` saves,
        what was returned in the form ``Epoch.consumer_progress()`` gives."""
        epoch_class = getattr(self._sampler, "epoch_class", Epoch)
        epoch, done, ahead = self._epoch, epoch_class.unopened_progress(None), {}
        until = self._default_until(epoch)
        active, resume = self._active, self._resume
        if resume is not None and resume.epoch == epoch:
            done = epoch_class.unopened_progress(resume.done)
            ahead = {n: epoch_class.unopened_progress(v) for n, v in resume.ahead.items()}
            if resume.until is not _LOADER_EPOCHS:
                until = resume.until
        elif active is not None and active.owns_epoch():
            point = active.resume_point()
            if point is not None:
                epoch, done, ahead, until = point
        return epoch, done, ahead, until

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next ``iter()`` continues that epoch where it stood.

        An epoch in progress on this loader is ended. Raises ``ValueError`` if the state
        comes from a loader over different data or with other settings (for an indexable
        source: length, batch_size, shuffle, seed, drop_last, shard, reshuffle; for a
        streaming source, see ``state_dict``), naming the setting.
        """
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError(f"not a procpipe Loader state (from Loader.state_dict(), version 1): {state!r:.200}")
        streaming = isinstance(self._sampler, StreamPlan)
        if ("stream" in state) != streaming:
            kinds = ("an indexable source", "a streaming source (procpipe.Shards)")
            raise ValueError(f"this state was saved by a loader over {kinds['stream' in state]}, but this loader "
                             f"reads {kinds[streaming]}; resume with a loader built with the same arguments")
        settings = _sampler_state(self._sampler)
        for key, mine in settings.items():
            if state.get(key, _STATE_DEFAULTS.get(key)) != mine:
                raise ValueError(
                    f"this state was saved by a loader with {key}={state.get(key)!r}, but this loader has "
                    f"{key}={mine!r}; resuming needs the same data and settings ({', '.join(settings)})."
                )
        epoch = state.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"corrupt procpipe Loader state: epoch={epoch!r}")
        if streaming:
            done = self._sampler.check_progress(state.get("stream"), epoch)
            until, ahead = _parse_stream_state(state, epoch, self._stream_ahead_entry)
        else:
            done = _index_progress(epoch, [state.get("done_below"), state.get("done")])
            until, ahead = _parse_stream_state(state, epoch, _index_progress)
        if self._active is not None:
            self._active.cancel("load_state_dict() was called")
            self._active = None
        self._epoch = epoch
        self._resume = _Resume(epoch, done, until, ahead)

    def _stream_ahead_entry(self, epoch: int, rest: list) -> dict:
        """``[stream]`` of an ``ahead`` entry of a streaming source's state, checked."""
        if len(rest) != 1 or rest[0] is None:
            raise ValueError(f"corrupt procpipe Loader state: ahead entry for epoch {epoch}: {rest!r:.200}")
        return self._sampler.check_progress(rest[0], epoch)

    def close(self) -> None:
        """End every worker and remove every shared-memory file. Safe to call twice.

        Batches already delivered stay valid: their memory is freed when the last array
        of each is dropped.
        """
        if self._active is not None:
            self._active.cancel("the loader was closed")
        self._closed = True
        self._finalizer()
        if self._spec.cache is not None:
            self._spec.cache.close()

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

    def cache_info(self) -> dict[str, Any] | None:
        """The cache (``cache=...``): ``directory``, ``samples`` (its length), ``filled``
        (indices computed so far), ``sample_bytes``, ``bytes`` (the file); None without one."""
        cache = self._spec.cache
        return None if cache is None or self._closed else cache.info()

    @property
    def shm_prefix(self) -> str | None:
        """Path prefix of every shared-memory file this loader creates."""
        return None if self._coordinator is None else self._coordinator.files.prefix

    def stats(self) -> dict[str, Any]:
        """Statistics of the current epoch, or of the last one once it ended: a plain dict.

        The counters are always on (a few additions per batch); this call only reads
        them. Every figure covers one epoch, from ``iter(loader)`` to the end of that
        iteration, except ``tasks_total``, ``restarts`` and the memory figures of
        ``per_worker``, which cover the loader's whole life, and ``autotune``. With
        ``epochs=N``/``None`` "the epoch" is the one the last batch returned belongs to;
        its time starts where the consumer finished the previous epoch.

        Keys:
            epoch: the epoch number (``None`` before the first ``iter(loader)``).
            running: True while the epoch's iterator is live (not exhausted, failed or
                cancelled by a new ``iter()`` or ``close()``).
            workers: worker processes configured (0: everything runs in ``next()``;
                with ``workers="auto"``, the number the tuner runs now).
            wall_s: seconds since ``iter(loader)``, up to the end of the iteration.
            batches, samples: batches and samples loaded and handed over by the engine
                this epoch (ready for, or already returned by, ``next()``).
            batches_consumed: batches ``next()`` has returned so far.
            batches_per_s, samples_per_s: ``batches`` and ``samples`` over ``wall_s``.
            wait_s: seconds the consumer spent inside ``next()`` waiting for a batch
                (with ``workers=0``, producing it: the whole cost of loading).
            wait_fraction: ``wait_s / wall_s`` in [0, 1]: how input-bound the training
                loop is ("input-bound %" is 100 times this). Near 0: the pipeline keeps up.
            bytes: bytes of array data delivered: the sum of ``.nbytes`` of every numpy
                array of every batch (objects that are not arrays are not counted).
            bytes_per_s: ``bytes / wall_s``.
            bytes_in_slots: bytes the workers wrote into ring slots (each array padded
                to 64 bytes).
            bytes_inline: bytes that came through the workers' pipes instead (batches
                before the ring existed, and overflows); 0 with ``workers=0``.
            overflow_batches: batches larger than their slot, delivered on the slower
                inline path (pass a larger ``slot_bytes`` if this is not 0).
            redispatched_tasks: batches loaded again because their worker died.
            worker_deaths: workers that died this epoch.
            skipped: indices left out this epoch by ``on_error="skip"``, in the order met.
            speculative_tasks: extra attempts given to straggling batches (``speculate``).
            timed_out_tasks: attempts killed after ``task_timeout``.
            ring_slots, ring_slot_bytes: the ring's size (0 before the first batch sized
                it, and with ``workers=0``).
            ring_slots_in_use: slots now being filled, queued or held by live batches.
            ring_peak_slots_in_use: the most slots in use at once this epoch.
            ring_occupancy, ring_peak_occupancy: the two above as fractions of ``ring_slots``.
            worker_busy_fraction: mean over workers of ``per_worker[i]["busy_fraction"]``.
            worker_tasks: sum of ``per_worker[i]["tasks"]``.
            worker_peak_rss_bytes: the largest ``peak_rss_bytes`` of any worker.
            per_worker: one dict per worker (empty with ``workers=0``):
                index, pid; tasks (batches done this epoch); busy_s (seconds spent
                loading and collating this epoch); busy_fraction (``busy_s / wall_s``, in
                [0, 1]); tasks_total (since the loader started); restarts; rss_bytes
                and peak_rss_bytes (resident memory, sampled by psutil every 0.5 s;
                it includes the ring pages the worker has touched). With ``workers="auto"``,
                a retired worker is listed only in an epoch it worked in (``pid`` None).
            autotune: None unless ``workers="auto"``; else ``workers`` (now), ``min``,
                ``max``, ``limit`` (the most it may use now: CPUs, I/O, memory),
                ``capacity`` (workers the ring serves), ``cpus``, ``io_bound``,
                ``contended``, ``changes``, and ``trace``: ``[time_s, workers,
                batches_per_s, wait_fraction]`` per control interval (the last 2000),
                over the loader's life.
        """
        from .stats import snapshot

        active = self._active
        running = active is not None and not active._done
        coordinator = self._coordinator
        if coordinator is None:
            out = snapshot(self._last_counters, workers=0, running=running, consumed=None)
            out["autotune"] = None
            return out
        epoch = getattr(active, "_epoch", None)
        counters = list(coordinator.worker_counters)
        pids: list[int | None] = [None] * len(counters)
        for w in list(coordinator.workers):
            if w.index < len(pids):
                pids[w.index] = w.process.pid
        out = snapshot(
            self._last_counters, workers=coordinator.n_workers if coordinator.tuner is not None else self._workers,
            running=running, consumed=epoch.consumed if epoch is not None else None, ring=coordinator.ring,
            worker_counters=counters, pids=pids,
        )
        out["autotune"] = coordinator.autotune_info()
        return out


def _close_engine(coordinator: Coordinator | None) -> None:
    if coordinator is not None:
        coordinator.close()


class _EpochIterator:
    """One ``iter(loader)`` with workers: the epochs of a ``Stream``, read from its one queue.

    Items are ``(epoch, position, batch)``; an ``EpochEnd`` marker follows each epoch's
    last batch, ``EndOfEpoch`` the stream's. ``number`` is the latest epoch the consumer
    has entered (whose counters ``stats()`` shows); ``_low`` the oldest it is not past.
    """

    def __init__(self, loader: Loader, number: int, done: frozenset = frozenset(), until: int | None = None,
                 ahead: dict[int, frozenset] | None = None) -> None:
        self._loader = loader
        self._coordinator = loader._coordinator
        self.number = number
        self._with_epoch = loader._with_epoch
        self._stream = Stream(next(_generations), loader._sampler, number, until, loader._ordered,
                              loader._sampler.batches(number), done, ahead)
        self._epoch = self._stream.first  # the epoch the consumer is in
        self.batch_count = len(self._epoch.batches)
        self._low = number
        self._ended: set[int] = set()  # epochs at or above _low whose EpochEnd the consumer has seen
        self._done = False
        self._complete = False  # every batch of the stream was returned
        self._cancelled: str | None = None
        loader._last_counters = self._epoch.counters
        self._set_epoch(number + 1)
        self._coordinator.submit("start", self._stream)

    def __iter__(self) -> _EpochIterator:
        return self

    def _set_epoch(self, epoch: int) -> None:
        """Move ``loader.epoch`` along (unless the user chose one with ``set_epoch`` meanwhile)."""
        loader = self._loader
        if getattr(self, "_epoch_set", None) in (None, loader._epoch):
            loader._epoch = self._epoch_set = epoch

    def owns_epoch(self) -> bool:
        """``loader.epoch`` is still what this iteration made it (for ``state_dict``)."""
        return self._loader._epoch == getattr(self, "_epoch_set", None)

    def __next__(self) -> Any:
        if self._done:
            iteration_over(self._cancelled)
        stream = self._stream
        started = time.perf_counter()
        while True:
            item = self._get()
            if type(item) is tuple:
                epoch, seq, batch = item
                waited = time.perf_counter() - started
                epoch.counters.wait_s += waited
                stream.wait_s += waited
                self._coordinator.consumed_one(stream, epoch, seq)
                if epoch.number > self.number:
                    self._enter(epoch)
                return (epoch.number, batch) if self._with_epoch else batch
            if isinstance(item, EpochEnd):
                self._epoch_end(item.epoch)
                continue
            now = time.perf_counter()
            self._epoch.counters.wait_s += now - started
            stream.wait_s += now - started
            self._done = True
            if item is EndOfEpoch:
                self._epoch.counters.ended = now  # the consumer's end of the epoch (stats)
                if not self._cancelled:
                    self._complete = True
                    self._set_epoch(stream.until if stream.until is not None else stream.next_number)
                raise StopIteration
            raise item.exc  # a Failure

    def _enter(self, epoch: Epoch) -> None:
        """The consumer received the first batch of a later epoch."""
        self.number = epoch.number
        self._epoch = epoch
        self.batch_count = len(epoch.batches)
        self._loader._last_counters = epoch.counters
        self._set_epoch(epoch.number + 1)

    def _epoch_end(self, epoch: Epoch) -> None:
        now = time.perf_counter()
        epoch.counters.ended = now  # the consumer's end of that epoch
        following = self._stream.opened.get(epoch.number + 1)
        if following is not None and following.consumed == 0:
            following.counters.started = now  # its time, for stats, starts where this one's ends
        self._ended.add(epoch.number)
        while self._low in self._ended:
            self._ended.discard(self._low)
            self._stream.opened.pop(self._low, None)
            self._low += 1

    def _get(self) -> Any:
        out = self._stream.out
        while True:
            try:
                return out.get(timeout=_CONSUMER_POLL_S)
            except queue.Empty:
                if not self._coordinator.is_alive():
                    return Failure(RuntimeError("procpipe's coordinator thread has stopped; the loader was closed"))

    def done_seqs(self) -> Progress:
        """Batch positions of the current epoch the consumer has had."""
        return self._epoch.done_seqs()

    def resume_point(self) -> tuple[int, Any, dict[int, Any], int | None] | None:
        """``(epoch, what was returned of it, of later epochs, until)`` to resume this iteration
        exactly (see ``Stream.resume_point``); None once every batch of it was returned."""
        if self._complete:
            return None
        return self._stream.resume_point(self._low)

    def cancel(self, why: str) -> None:
        if not self._done:
            self._done = True
            self._cancelled = why
            self._coordinator.submit("cancel", self._stream.gen)
            self._stream.out.put(EndOfEpoch)  # wakes a reader blocked in another thread (device stage)

    def __del__(self) -> None:
        if not self._done and self._coordinator is not None:
            self._coordinator.submit("cancel", self._stream.gen)


class _InlineIterator(_EpochIterator):
    """``workers=0``: the same sampler, sample scope and collation, in the calling process."""

    def __init__(self, loader: Loader, number: int, done: frozenset = frozenset(), until: int | None = None,
                 ahead: dict[int, frozenset] | None = None) -> None:
        self._loader = loader
        self._coordinator = None
        self._with_epoch = loader._with_epoch
        self._until = until
        self._ahead = dict(ahead or {})
        self._scope = SampleScope(loader._spec.seed)
        self._done = False
        self._complete = False
        self._cancelled = None
        self._open(number, loader._sampler.batches(number), done, time.perf_counter())

    def _open(self, number: int, batches: list[list[int]], done: frozenset, started: float) -> None:
        loader = self._loader
        self._number = self.number = number
        self.batch_count = len(batches)
        self._batches = ((seq, b) for seq, b in enumerate(batches) if seq not in done)
        self._progress = Progress(done)
        self._counters = loader._last_counters = EpochCounters(epoch=number, started=started)
        self._skips = SkipBudget(loader._max_skipped, batches, self._counters) if loader._spec.skip else None
        self._set_epoch(number + 1)

    def __next__(self) -> Any:
        if self._done:
            iteration_over(self._cancelled)
        started = time.perf_counter()
        while True:
            item = next(self._batches, None)
            if item is None:
                now = time.perf_counter()
                self._counters.ended = now
                following = self._number + 1
                if (self._until is not None and following >= self._until) or (self._until is None and not self.batch_count):
                    self._done = self._complete = True
                    raise StopIteration
                try:
                    batches = self._loader._sampler.batches(following)
                except Exception:
                    self._done = True
                    raise
                self._open(following, batches, self._ahead.pop(following, frozenset()), now)
                started = now
                continue
            seq, indices = item
            try:
                layout, kept = self._load(seq, indices)
            except Exception:
                self._done = True
                raise
            self._progress.add(seq)
            if layout is not None:  # None: on_error="skip" left out every sample of the batch
                break
        counters = self._counters
        counters.batches += 1
        counters.samples += len(kept)
        counters.array_bytes += array_bytes(layout)
        batch = collate.build(layout, None)
        counters.wait_s += time.perf_counter() - started
        return (self._number, batch) if self._with_epoch else batch

    def _load(self, seq: int, indices: list[int]) -> tuple[Any, list[int]]:
        """One batch's layout and the indices in it (``on_error="skip"`` may leave some out)."""
        skips, scope = self._skips, self._scope
        try:
            batch = produce(self._loader._spec, scope, self._number, indices, None, 0)
        except Exception as exc:
            index = scope.index
            scope.leave()
            if skips is not None:  # a sample failure would have been skipped: collation failed
                if skips.add(indices, f"batch {seq} (indices {indices})", f"collating it failed: {_describe(exc)}"):
                    return None, indices
                exc.add_note(skips.note())
            where = f"while loading index {index}" if index is not None else f"while collating indices {indices}"
            exc.add_note(f"procpipe: raised in the calling process (workers=0) {where} (epoch {self._number}).")
            raise
        for index, exc in batch.skipped:
            if not skips.add([index], f"index {index} (batch {seq})", _describe(exc)):
                exc.add_note(skips.note())
                raise exc
        return batch.layout, batch.kept

    def done_seqs(self) -> Progress:
        return self._progress

    def resume_point(self) -> tuple[int, Progress, dict[int, Progress], int | None] | None:
        if self._complete:
            return None
        low, done, until = self._number, Progress(self._progress), self._until
        if len(done) >= self.batch_count:  # all returned; the next epoch not begun
            low += 1
            if until is not None and low >= until:
                return None
            done = Progress(self._ahead.get(low, ()))
        ahead = {n: Progress(v) for n, v in sorted(self._ahead.items()) if n > low and v}
        return low, done, ahead, until

    def cancel(self, why: str) -> None:
        if not self._done:  # like the workers' iterator: a superseded epoch says so
            self._done = True
            self._cancelled = why

    def __del__(self) -> None:
        pass


def _context(start_method: str, env: dict[str, str], files: SharedFiles) -> Any:
    """The multiprocess context; a forkserver preloads what the parent has imported, once."""
    ctx = multiprocess.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["procpipe.preload"])
        # The forkserver process inherits the environment when it starts: start it with
        # the workers' settings so libraries it preloads (numpy's BLAS) see them. The
        # module list goes in a file (it can be too long for an environment variable);
        # a server that starts reads it before it forks the first worker.
        from multiprocess import forkserver

        preload = files.path("preload")
        with open(preload, "w") as f:
            f.write("\n".join(_imported_modules()))
        server_env = dict(env, PROCPIPE_PRELOAD_FILE=preload)
        saved = {k: os.environ.get(k) for k in server_env}
        os.environ.update(server_env)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return ctx


def _imported_modules() -> list[str]:
    """The modules the parent has imported, for the forkserver to preload.

    Every worker imports the main module again (the spawn-style start), and with it
    whatever it imports: torch alone takes about a second, and a script's standard-library
    and own imports add up to tens of milliseconds more. Preloading them once in the
    forkserver makes each worker start in milliseconds. (CPython's own ``"__main__"``
    preload does not take effect: it never receives the main path.) Sorted, so packages
    come before their submodules; private and built-in modules come with their parents.
    """
    return sorted(
        name for name, module in list(sys.modules.items())
        if not name.startswith("_") and name not in sys.builtin_module_names
        and getattr(module, "__spec__", None) is not None
    )


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


def _device_stage(device: Any, prefetch: int) -> Callable[[Iterator[Any]], Iterator[Any]]:
    from . import torch_device as adapter  # lazy: plain ``import procpipe`` never imports torch

    return adapter.device_stage(device, prefetch)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"


def _sampler_state(sampler: Any) -> dict[str, Any]:
    """The sampler settings a saved state must match to be resumed."""
    if isinstance(sampler, StreamPlan):
        return sampler.settings()
    shard = getattr(sampler, "shard", None)
    return {"length": sampler.length, "batch_size": getattr(sampler, "batch_size", None),
            "shuffle": getattr(sampler, "shuffle", False), "seed": getattr(sampler, "seed", None),
            "drop_last": getattr(sampler, "drop_last", False), "shard": None if shard is None else list(shard),
            "reshuffle": getattr(sampler, "reshuffle", True)}


_STATE_DEFAULTS = {"reshuffle": True}  # for states saved before the key existed
_LOADER_EPOCHS = "loader"  # a state without "until": the next iteration spans the loader's own ``epochs``


class _Resume(tuple):
    """What ``load_state_dict`` left for the next ``iter()``: ``done`` and ``ahead``'s values are
    frozensets of batch positions, or for a streaming source ``StreamProgress`` states (or None)."""

    def __new__(cls, epoch: int, done: Any, until: Any, ahead: dict[int, Any]) -> _Resume:
        return super().__new__(cls, (epoch, done, until, ahead))

    epoch = property(lambda self: self[0])
    done = property(lambda self: self[1])
    until = property(lambda self: self[2])  # int, None (endless) or _LOADER_EPOCHS
    ahead = property(lambda self: self[3])


def _parse_stream_state(state: dict[str, Any], epoch: int,
                        progress: Callable[[int, list], Any]) -> tuple[Any, dict[int, Any]]:
    """``until`` and ``ahead`` of a saved state, checked (both optional: older states lack them).

    ``ahead`` entries are ``[epoch, ...]``; ``progress(epoch, rest)`` checks and converts the rest.
    """
    until = state.get("until", _LOADER_EPOCHS)
    if until is not _LOADER_EPOCHS and until is not None and (
            isinstance(until, bool) or not isinstance(until, int) or until <= epoch):
        raise ValueError(f"corrupt procpipe Loader state: until={until!r} with epoch={epoch!r}")
    ahead: dict[int, Any] = {}
    raw = state.get("ahead", [])
    if not isinstance(raw, list):
        raise ValueError(f"corrupt procpipe Loader state: ahead={raw!r:.200}")
    for entry in raw:
        n = entry[0] if isinstance(entry, list) and entry else None
        if (not isinstance(n, int) or isinstance(n, bool) or n <= epoch or n in ahead
                or (isinstance(until, int) and n >= until)):
            raise ValueError(f"corrupt procpipe Loader state: ahead entry {entry!r:.200}")
        ahead[n] = progress(n, entry[1:])
    return until, ahead


def _index_progress(epoch: int, rest: list) -> frozenset:
    """``[done_below, done]`` of an indexable source's epoch, checked: the positions returned."""
    ok = len(rest) == 2
    if ok:
        below, beyond = rest
        ok = (isinstance(below, int) and below >= 0 and isinstance(beyond, list)
              and all(isinstance(x, int) and x > below for x in beyond))
    if not ok:
        raise ValueError(f"corrupt procpipe Loader state: done_below, done = {rest!r:.200} for epoch {epoch}")
    return frozenset(itertools.chain(range(below), beyond))


def _validate_epochs(epochs: Any, reshuffle: Any, with_epoch: Any, batches: Any) -> None:
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise ValueError(f"epochs must be an int >= 1 or None (endless), got {epochs!r}")
    for name, value in (("reshuffle", reshuffle), ("with_epoch", with_epoch)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if batches is not None and not reshuffle:
        raise ValueError("batches=... decides every epoch's batches itself: reshuffle does not apply "
                         "(return the same batches for every epoch from the callable instead)")


def _validate(source: Any, fn: Any, batch_size: Any, workers: Any, prefetch: Any, seed: Any, collate_fn: Any,
              start_method: Any, shm_dir: Any, slot_bytes: Any, max_worker_restarts: Any, *,
              batches: Any = None, shard: Any = None, shuffle: Any = False, drop_last: Any = False,
              on_error: Any = "raise", max_skipped: Any = 0.01, task_timeout: Any = None,
              speculate: Any = None, batch_fn: Any = None, cache: Any = None, augment: Any = None) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if isinstance(max_skipped, bool) or not (
            (isinstance(max_skipped, int) and max_skipped >= 0)
            or (isinstance(max_skipped, float) and 0.0 <= max_skipped <= 1.0)):
        raise ValueError(f"max_skipped must be an int >= 0 (a count) or a float in [0, 1] (a fraction of the "
                         f"epoch's samples), got {max_skipped!r}")
    if task_timeout is not None and (isinstance(task_timeout, bool) or not isinstance(task_timeout, (int, float))
                                     or not task_timeout > 0):
        raise ValueError(f"task_timeout must be None or a number of seconds > 0, got {task_timeout!r}")
    if speculate is not None and (isinstance(speculate, bool) or not isinstance(speculate, (int, float))
                                  or not speculate >= 1):
        raise ValueError(f"speculate must be None or a number >= 1 (a multiple of the median batch time), "
                         f"got {speculate!r}")
    for name, value in (("batch_fn", batch_fn), ("augment", augment)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
    if batch_fn is not None and batch_size is None:
        raise ValueError("batch_fn needs a batch_size: with batch_size=None samples are yielded unbatched "
                         "(apply the function in fn or augment instead)")
    validate_cache(cache)
    if not isinstance(source, Shards) and not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise TypeError(
            f"source must support len() and indexing with an int (a list, a numpy array, a torch Dataset...); "
            f"got {type(source).__name__}, which lacks "
            f"{'__len__' if not hasattr(source, '__len__') else '__getitem__'}. Wrap iterables in a list first."
        )
    for name, value in (("fn", fn), ("collate_fn", collate_fn)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
    _check_int("batch_size", batch_size, 1, allow_none=True)
    if resolve_autotune(workers) is None:
        if isinstance(workers, str):
            raise ValueError(f"workers must be an int >= 0 or 'auto', got {workers!r}")
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
    if batches is not None:
        if not callable(batches):
            raise TypeError(f"batches must be a callable epoch -> list of index lists, got {type(batches).__name__}")
        if shuffle or drop_last or shard is not None:
            raise ValueError(
                "batches=... decides every epoch's batches itself: shuffle, drop_last and shard do not apply "
                "(leave them at their defaults and shuffle, drop or shard inside the callable)"
            )
    if shard is not None:
        if (not isinstance(shard, (tuple, list)) or len(shard) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in shard)
                or not (shard[1] >= 1 and 0 <= shard[0] < shard[1])):
            raise ValueError(f"shard must be (rank, world_size) with 0 <= rank < world_size, got {shard!r}")


def _check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an int >= {minimum}{extra}, got {value!r}")
