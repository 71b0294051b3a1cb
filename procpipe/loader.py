"""``procpipe.Loader``: the public entry point.

The Loader checks its arguments into a frozen configuration (``loader.config``: config.py),
plans its epochs (_sources/indexed/index_order.py, or the _sources/stream/ package for a ``procpipe.Shards`` source),
makes its parts from the configuration (assembly.py: the worker spec, the engine and its
workers, once) and hands each iteration to an epoch iterator (_consumer/epoch_iterator.py),
the object the consumer calls ``next()`` on. Iterating it once is one epoch (or ``epochs=N``, or endless
with ``epochs=None``); workers persist between iterations. With ``workers=0`` everything runs
in the calling process through the same order, sample scope and collation, so results are
identical. The iterator is a chain of nodes (nodes.py: the epoch iterator, then the device
stage with ``device=``); ``state_dict`` is the root node's ``get_state()`` with the order's
settings, and ``load_state_dict`` checks one and leaves it for the next ``iter()`` (state.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ._consumer.assembly import assemble
from ._consumer.epoch_iterator import EpochIterator
from ._consumer.inline import InlineDriver
from ._consumer.iteration_context import LoaderIterator
from ._consumer.nodes import Node
from ._core.reassembly import ResumePoint
from ._engine.commands import ReserveSlots
from ._sources.epoch_plan import Order
from ._sources.resolve import resolve_kind
from ._sources.saved_state import encode_position, start_position
from ._sources.source_kind import load_state, save_state
from .config import LoaderConfig

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; typing_extensions is read by type checkers only


class Loader:
    """Loads batches from ``source`` with worker processes, through a shared-memory ring.

    Args:
        source: any object with ``__len__`` and ``__getitem__(int)``.
        fn: optional per-sample function, ``fn(source[i]) -> sample``; runs in the workers.
        batch_size: samples per batch; ``None`` yields single samples, unbatched.
        workers: worker processes; ``0`` runs everything in the calling process;
            ``"auto"`` (or a ``procpipe.AutoWorkers(...)``) starts with 2 and adds (in
            doubling steps) or retires workers while running, until the consumer no longer
            waits or more workers stop helping (bounded by the CPUs this process may use,
            affinity and cgroup quota, less what the training step uses, or more when
            workers wait on I/O, and by memory; auto-tuned loaders on one node share its
            CPUs); ``stats()["autotune"]`` shows its trace. See docs/guide/autotuning.md.
        ordered: ``True`` yields batches in order order; ``False`` yields them as they
            finish ("sloppy"), so a slow batch does not hold back the others.
        prefetch: ready batches kept ahead of the consumer.
        shuffle: ``True`` draws the order of each epoch as a permutation from ``(seed, epoch)``.
        seed: the seed of the shuffle and of the per-sample generators (``sample_rng()``).
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
        start_method: ``"auto"`` (default): ``"fork"`` when the calling process runs no other
            thread (beyond numpy's BLAS pool; fastest: nothing is imported or shipped), else
            ``"zygote"`` (forked from the copy of the process ``import procpipe`` made while it was
            safe to fork), else ``"forkserver"`` (safe when the parent runs threads); or one of
            ``"forkserver"``, ``"spawn"``, ``"fork"``, ``"zygote"``. Resolved once, when the loader is
            created (``loader.start_method``).
            Workers never import the main script (procpipe._worker.start_method), so
            no ``if __name__ == "__main__":`` guard is needed.
        shm_dir: None (the default): the ring is anonymous shared memory (``memfd``), limited by
            memory only (a container's ``/dev/shm`` size does not matter) and gone with the last
            process using it; a directory: the ring's files go there instead (a hugepages
            mount, a disk), as ``procpipe-<pid>-<token>-ring<k>``.
        slot_bytes: size of a ring slot; by default a full batch's, from the first batch to
            arrive (scaled up if it was short). A larger batch makes the ring grow.
        max_worker_restarts: worker deaths tolerated per epoch before the epoch fails.
        worker_env: environment variables set in each worker (by default, one thread
            per math library).
        batches: optional ``batches(epoch) -> list of index lists``, called once per epoch
            in the calling process, replacing the built-in order (``shuffle`` and
            ``drop_last`` must then stay off). Each inner list is one batch, any size;
            with ``batch_size=None`` every list must hold one index. A ``len()`` on the
            callable, if it has one, is the loader's ``len()``. ``procpipe.torch.DataLoader``
            uses it to follow a torch order.
        shard: ``(rank, world_size)`` for data-parallel training: each rank gets a disjoint,
            equal-length part of every epoch's order, like ``DistributedSampler``: the
            order is padded by repeating its first indices up to a multiple of
            ``world_size``, then rank ``r`` takes positions ``r, r + world_size, ...``.
            Use the same ``seed`` on every rank. A ``Shards`` source is sharded by whole shards.
        even_ranks: with ``shard=`` and a ``Shards`` source with ``lengths``: every rank gets the
            same number of batches per epoch, by leaving out the records past the fewest any
            rank has (docs/guide/scale.md); an indexed source's ranks are already equal.
        device: ``None`` yields numpy batches; ``"cpu"`` yields torch tensors sharing memory
            with the ring; ``"cuda"``/``"cuda:N"`` yields tensors already on that device,
            copied by a background thread through pinned memory on its own CUDA stream.
            Needs torch (imported only when ``device`` is given); see
            ``procpipe.torch.device`` and README.md, "Device prefetch". The ring is
            registered with CUDA (page-locked in place), so batches are copied straight
            from their slots.
        device_fn: optional ``device_fn(batch) -> batch``, run on each batch once it is on
            ``device``: in the device stage's thread and on its CUDA stream (overlapping
            training), e.g. uint8 -> float, normalization, crops and flips, or GPU JPEG
            decoding of bytes the workers read. ``procpipe.batch_rng()`` works inside it,
            seeded from ``(seed, epoch, the batch's position in the epoch)``. Needs a
            ``device``.
        on_error: ``"raise"`` (default): an exception in ``fn``/``__getitem__``/``collate_fn``
            is raised by ``next()`` in place of its batch; the next ``next()`` goes on with
            the following batches (as torch's DataLoader). ``"skip"``: a failing sample is left out of
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
            in shared memory (a file in ``shm_dir`` when given), computed once, and read back in later epochs;
            a directory path: the same in a memory-mapped file there (data larger than
            memory). The first sample is computed when the loader is created, to lay the
            cache out (typed arrays: every sample must match its structure, dtypes and
            shapes). The cache is removed with the loader. See README.md,
            "Pipeline stages: batch_fn, cache and augment".
        augment: optional ``augment(sample) -> sample``, run every epoch after ``fn`` (or
            on a copy of the cached sample); the place for random augmentation with
            ``sample_rng()`` when ``cache`` is on.
        shuffle_buffer: streaming sources (``procpipe.Shards``) only: shuffle records
            through a buffer of this many records in the calling process, like tf.data's
            ``shuffle(buffer_size)``; deterministic from ``(seed, epoch)`` with ``ordered=True``.
            See README.md, "Streaming sources: shards and parallel interleave".
        seed_globals: ``True`` (default, the same as ``"task"``): Python's ``random``, ``np.random``
            and torch's default generator (if torch is imported; it is never imported for
            this) are seeded once per batch (a streaming source: per block), before its first
            sample, from ``(seed, epoch, the batch's first index)``, so code drawing from them
            (torchvision-style transforms) gets distinct, reproducible values per sample,
            whatever the worker count, the schedule or re-runs. ``"sample"``: seeded before
            every sample from ``(seed, epoch, index)`` (a sample's draws then do not depend on
            which batch it is in; ~12 us a sample). ``False``: leave them alone. With
            ``workers=0`` the caller's generator states are put back after each batch.
            See docs/guide/startup.md.
        backend: None (default): worker processes on this machine. ``procpipe.ray.Backend(...)``:
            the workers run on a Ray cluster (``workers`` per node); see README.md, "Beyond one
            machine: Ray". Every other argument keeps its meaning.
        assign: which worker loads which batch of an indexed source. ``"balanced"`` (default):
            the least busy worker, so a slow batch holds back no other and the workers stay
            evenly loaded. ``"round_robin"``: batch k of every epoch goes to worker
            ``k % workers``, as torch's DataLoader schedules (needs an int ``workers``): what
            each worker loads is then known in advance (per-worker seeds and per-worker state
            repeat run after run), at the price of balance: a slow batch holds back its worker's
            next ones. A dead worker's batches run on another worker either way. Streaming
            sources keep their shards' own lanes.
        stage_slots: extra ring slots for a stage of the caller's that holds batches while it
            reads them (e.g. ``procpipe.torch.DataLoader(device=...)``'s CUDA transfer, whose
            copies read batches straight from their slots); ``device=`` adds its own.

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
        collate_fn: Callable[[list[Any]], Any] | None = None,
        start_method: str = "auto",
        shm_dir: str | None = None,
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
        device_fn: Callable[[Any], Any] | None = None,
        seed_globals: bool | str = True,
        stage_slots: int = 0,
        backend: Any = None,
        even_ranks: bool = False,
        assign: str = "balanced",
    ) -> None:
        # every argument but the source, as passed: into the checked groups (config.py), once
        config = self._config = LoaderConfig.from_arguments(
            fn=fn,
            batch_size=batch_size,
            workers=workers,
            ordered=ordered,
            prefetch=prefetch,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            reshuffle=reshuffle,
            epochs=epochs,
            with_epoch=with_epoch,
            collate_fn=collate_fn,
            start_method=start_method,
            shm_dir=shm_dir,
            slot_bytes=slot_bytes,
            max_worker_restarts=max_worker_restarts,
            worker_env=worker_env,
            batches=batches,
            shard=shard,
            device=device,
            on_error=on_error,
            max_skipped=max_skipped,
            task_timeout=task_timeout,
            speculate=speculate,
            batch_fn=batch_fn,
            cache=cache,
            augment=augment,
            shuffle_buffer=shuffle_buffer,
            device_fn=device_fn,
            seed_globals=seed_globals,
            stage_slots=stage_slots,
            backend=backend,
            even_ranks=even_ranks,
            assign=assign,
        )
        # Which kind of source this is, asked once (_sources/resolve.py): its plan, the reader, workers=0's driver
        self._kind = kind = resolve_kind(source, config)
        self._order: Order = kind.order
        self._parts = assemble(config, kind)  # workers start here
        self._coordinator, self._context = self._parts.coordinator, self._parts.context
        self._resume: dict[str, Any] | None = None  # from load_state_dict: the position the next iter() starts at
        self._active: LoaderIterator | None = None  # the source node of the latest iteration
        self._root: Node | None = None  # the node the consumer iterates: the source, or a device stage over it
        self._closed = False
        self._standing = self._context.standing

    # ------------------------------------------------------------------ public API
    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._order)

    def __iter__(self) -> Iterator[Any]:
        """Start the next epoch, or ``epochs`` epochs (ending an unfinished previous iteration), and iterate."""
        return self.iterate()

    def iterate(self, stage: Callable[[Node], Node] | None = None) -> Iterator[Any]:
        """``iter(loader)``, with ``stage`` (optional) over the iteration's nodes: the consumer's end.

        ``stage(node)`` gets the node ``iter(loader)`` would return (the source, or the device
        stage over it) and returns the node the caller iterates, e.g. a
        ``procpipe._consumer.prefetch.Prefetcher`` that copies batches to an accelerator ahead of the
        training step (``procpipe.jax.iterator``). ``state_dict()`` is then that node's
        ``get_state()``: a stage that holds batches ahead reports the state of the batch it
        returned last (``procpipe._consumer.nodes``), so the batches it holds are not counted as
        returned and a resume repeats nothing and skips nothing.
        """
        if self._closed:
            raise RuntimeError("this procpipe.Loader is closed; create a new one to load more data")
        if self._coordinator is not None and self._coordinator.foreign():
            raise RuntimeError(
                "this procpipe.Loader was created in another process (this one is a fork of it); "
                "its workers serve that process only: create a new Loader here"
            )
        self._end_iteration("a new iteration over the loader started")
        epoch = self._standing.epoch
        self._standing.epoch += 1
        resume, self._resume = self._resume, None
        if resume is None or resume["epoch"] != epoch:
            resume = start_position(self._order, epoch, self._context.default_until(epoch))
        if self._coordinator is None:
            it: LoaderIterator = InlineDriver(self._context, resume, self._kind.names)
        else:
            it = EpochIterator(self._context, resume)
        self._active = self._root = it
        root: Node = it
        if self._parts.device_stage is not None:
            root = self._parts.device_stage(it)
        if stage is not None:
            root = stage(root)
        self._root = root
        return root

    @property
    def epoch(self) -> int:
        """The epoch number the next ``iter(loader)`` will start with (during an iteration over
        several epochs: the one after the epoch of the last batch returned)."""
        return self._standing.epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch number of the next iteration (its shuffle order and sample seeds)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self._standing.epoch = epoch

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
        already returned: ``ordered=False`` across an epoch boundary), plus the order's
        settings, checked on load.

        For a streaming source (``procpipe.Shards``) what was returned is counted in
        records: ``stream`` replaces ``done_below``/``done`` (None, or the
        ``procpipe._sources.stream.StreamProgress`` state of the epoch: ``complete`` shards, the
        ordered interleave's ``cursor``, ``received`` record ranges), ``ahead`` entries are
        ``[epoch, stream]``, and the settings checked are ``shards`` (their number),
        ``batch_size``, ``shuffle``, ``seed``, ``drop_last``, ``shard``, ``reshuffle``,
        ``cycle_length``, ``block_length``, ``mode`` and ``shuffle_buffer``. Records
        returned are not returned again, the others are, once; with ``ordered=True`` (and
        no ``shuffle_buffer``) in the very order of the uninterrupted run.
        """
        # Where the loader stands: what load_state_dict left for the next iter(); else the root node's
        # state while its iteration decides loader.epoch; else the start of loader.epoch.
        epoch = self._standing.epoch
        active, root = self._active, self._root
        if self._resume is not None and self._resume["epoch"] == epoch:
            position = self._resume
        elif active is not None and root is not None and active.owns_epoch():
            position = root.get_state()
        else:
            position = start_position(self._order, epoch, self._context.default_until(epoch))
        return save_state(self._kind, position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next ``iter()`` continues that epoch where it stood.

        An epoch in progress on this loader is ended. Raises ``ValueError`` if the state
        comes from a loader over different data or with other settings (for an indexable
        source: length, batch_size, shuffle, seed, drop_last, shard, reshuffle; for a
        streaming source, see ``state_dict``), naming the setting.
        """
        resume = load_state(state, self._kind)
        self._end_iteration("load_state_dict() was called")
        self._active = self._root = None
        self._standing.epoch = resume.epoch
        self._resume = encode_position(
            self._order,
            ResumePoint(
                resume.epoch, resume.done, resume.ahead, resume.until_or(self._context.default_until(resume.epoch))
            ),
        )

    def close(self) -> None:
        """End every worker and remove every shared-memory file. Safe to call twice.

        Batches already delivered stay valid: their memory is freed when the last array
        of each is dropped.
        """
        self._end_iteration("the loader was closed")
        self._closed = True
        self._parts.close()

    def _end_iteration(self, reason: str) -> None:
        """End the iteration in progress, if any: cancel its source and stop the stage over it
        (a prefetching thread is joined, so none is left inside the user's transfer or a device
        copy once the loader goes on or closes). Both stay known, for ``state_dict()``."""
        active, root = self._active, self._root
        if active is not None:
            active.cancel(reason)
        close = getattr(root, "close", None)  # a caller's stage (iterate()) may be any iterator
        if close is not None and root is not active:
            close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def config(self) -> LoaderConfig:
        """Every argument of this loader but the source, checked, in six frozen groups: ``batching``,
        ``stages``, ``execution``, ``memory``, ``faults``, ``device`` (``procpipe.config``).
        Read-only (``print(loader.config)`` shows it all, a group per line); values as passed,
        ``"auto"`` included (``start_method`` has the start method resolved)."""
        return self._config

    @property
    def start_method(self) -> str:
        """The start method of this loader's workers: ``"fork"``, ``"zygote"``,
        ``"forkserver"`` or ``"spawn"``, never ``"auto"`` (resolved once, when the loader was created)."""
        return self._parts.start_method

    @property
    def workers_setting(self) -> int | str | Any:
        """``workers`` as it was passed: a count, ``"auto"`` or an autotune setting (the
        number running now, which autotuning changes, is ``len(worker_pids)``)."""
        return self._config.execution.workers

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (empty for ``workers=0`` or once closed)."""
        return [] if self._closed else [w.pid for w in self._parts.live_workers() if w.pid is not None]

    @property
    def worker_processes(self) -> list[Any]:
        """The live workers' process objects (``multiprocess.Process``: ``pid``, ``is_alive()``,
        ``join()``...), for code that watches them; empty for ``workers=0`` or once closed.
        procpipe starts, restarts and stops them: do not terminate them yourself. A worker that
        died is replaced by a new process, and its own object closed once procpipe has collected
        it (its descriptors released; ``exitcode`` and ``is_alive()`` then raise ``ValueError``):
        ask again for the current ones."""
        return [] if self._closed else [w.process for w in self._parts.live_workers() if w.process is not None]

    def cache_info(self) -> dict[str, Any] | None:
        """The cache (``cache=...``): ``directory``, ``samples`` (its length), ``filled``
        (indices computed so far), ``sample_bytes``, ``bytes`` (the file), ``error`` (why a damaged
        file cannot be read, ``filled`` None then: reported, never raised); None without one."""
        cache = self._parts.spec.cache
        return None if cache is None or self._closed else cache.info()

    def reserve_stage_slots(self, slots: int) -> None:
        """Keep at least ``slots`` ring slots spare, beyond ``stage_slots=``, for a consumer that
        holds batches as zero-copy views of the ring after it is done with them:
        ``procpipe.tf.dataset`` calls it (TensorFlow lets go of the arrays it adopted late), so a
        loader made with defaults needs no ``stage_slots=`` for it. The largest request counts;
        a ring that exists already gains the slots. Nothing to do for ``workers=0`` (no ring).

        Raises:
            ValueError: ``slots`` is not an int >= 0.
        """
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 0:
            raise ValueError(f"procpipe.Loader.reserve_stage_slots: slots must be an int >= 0, got {slots!r}")
        if self._coordinator is not None and not self._closed:
            self._coordinator.submit(ReserveSlots(slots))

    @property
    def shm_prefix(self) -> str | None:
        """Path prefix of every shared-memory file this loader creates in ``shm_dir``; None where its
        shared memory is anonymous (the default), which has no file names."""
        return None if self._coordinator is None else self._coordinator.segments.prefix

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
            ring_growths, ring_growth_s: larger rings made this epoch because a batch
                outgrew its slot, and the seconds that took (the coordinator thread
                creates and populates the new file; no batch is dispatched meanwhile).
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
                ``target`` (what the CPUs left by the training step keep busy),
                ``capacity`` (workers the ring serves), ``cpus`` (the CPUs this loader
                may use: its share of the node), ``main_cpu`` (the training process's CPU
                use), ``cpu_per_worker``, ``io_bound``, ``contended``, ``changes``, and
                ``trace``: ``[time_s, workers,
                batches_per_s, wait_fraction]`` per control interval (the last 2000),
                over the loader's life.
            backend: None for workers on this machine; with ``backend=procpipe.ray.Backend(...)``,
                ``agents`` (node id, pid, ready, alive), ``restarts`` (agents replaced) and
                ``events``: ``(seconds since start, "lost" | "replacing" | "ready", agent, detail)``.
            device: None without ``device=``; else, over the loader's life,
                ``direct_batches`` (copied straight from the CUDA-registered ring),
                ``staged_batches`` (through a pinned staging buffer: a ring that could
                not be registered), ``registered_rings`` (now) and ``registrations``.
        """
        return self._parts.stats(self._standing.counters, self._active, self._config.execution.workers)
