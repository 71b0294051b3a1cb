"""PyTorch adapter: a drop-in ``DataLoader`` (needs ``torch``).

``import procpipe`` never imports this package; it is loaded by ``import procpipe.torch``, or by the
first ``Loader(device=...)``, whose stage is ``procpipe.torch.device``'s (the device-stage registry's
``"torch"`` stage: ``procpipe._ext.register_device_stage``).

- ``procpipe.torch.DataLoader``: ``torch.utils.data.DataLoader`` with procpipe's engine.
  Same arguments, same meaning, same batches in the same order; switch by changing one
  import. Tensors produced in the workers travel through the shared-memory ring (never
  pickled) and arrive as tensors sharing memory with it.
- ``procpipe.torch.device``: ``Loader(device=...)``'s stage (``device_stage``), its conversion to
  tensors (``procpipe.torch.convert``) and CUDA copies (``procpipe.torch.cuda_transfer``).

Where it sits in the data path (coordinator -> worker -> ring slot -> reassembly ->
prefetch -> consumer): at both ends, in modules by job:

- ``procpipe.torch.kinds``: map-style or ``IterableDataset``, resolved once into a small
  strategy (``MapStyle`` / ``IterableStyle``) that this module asks wherever they differ;
- ``procpipe.torch.sampling``: a map-style dataset in the workers (``TorchSource``: torch's
  per-worker set-up, samples into numpy, tensors viewed, not copied) and each epoch's
  batches from the torch sampler (``SamplerBatches``);
- ``procpipe.torch.tensor_batches``: samples and ``collate_fn`` results on the wire (a custom
  ``collate_fn``'s result pickled *without* its tensors and arrays, which go through the
  ring), rebuilt in the consumer as zero-copy tensor views, whatever object holds them;
- ``procpipe.torch.epoch``: the epoch iterator, fed by ``procpipe.torch.device``'s stage
  thread when ``device=``, ``pin_memory=True`` or ``timeout`` asks for one;
- ``procpipe.torch.iterable``: an ``IterableDataset``, one replica per worker, each a
  streaming source; ``procpipe.torch.state``: ``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypedDict, TypeVar, cast

import torch
import torch.utils.data as _tud

from .._ext import spoken_as
from ..config import START_METHODS, LoaderConfig
from ..errors import ShippingError, Words
from ..loader import Loader
from .device import CudaTransfer, Stage, resolve_device
from .draws import generators_of
from .epoch import FacadeIterator
from .kinds import DatasetKind, TorchArguments, dataset_kind
from .sampling import SamplerBatches
from .snapshots import is_stateful
from .state import FacadeState, on_moved, on_value
from .state_schema import FINISHED, PROCPIPE, SEED

__all__ = ["DataLoader"]


# --------------------------------------------------------------------------- DataLoader facade
def _start_method(context: Any) -> str:
    if context is None:
        return "auto"
    method = context if isinstance(context, str) else context.get_start_method()
    if method not in START_METHODS:
        raise ValueError(
            f"multiprocessing_context={context!r}: procpipe.torch.DataLoader supports the start methods "
            f"{START_METHODS} (None: 'auto')"
        )
    return method


def _torch_context(context: Any) -> Any:
    """What torch's ``DataLoader`` is told of ``multiprocessing_context``: procpipe's own names
    (``"auto"``, ``"zygote"``), which torch's check refuses, as None (procpipe starts the workers)."""
    return None if context in ("auto", "zygote") else context


_T_co = TypeVar("_T_co", covariant=True)
# How procpipe's errors name a DataLoader user's options and objects (procpipe.errors.Words).
_WORDS = Words(
    owner="procpipe.torch.DataLoader",
    objects="the dataset, collate_fn or worker_init_fn",
    option="multiprocessing_context",
    auto="multiprocessing_context=None",
    lazily="inside __getitem__ or worker_init_fn",
)


class _LoaderOptions(TypedDict):
    """The facade's keyword arguments for each ``procpipe.Loader`` it makes (a plain dict at run
    time; typed so that a checker matches each key to the ``Loader`` parameter of that name)."""

    batch_size: int | None
    workers: int
    ordered: bool
    prefetch: int
    seed: int
    collate_fn: Callable[[list[Any]], Any] | None
    start_method: str
    shm_dir: str | None
    slot_bytes: int | None
    max_worker_restarts: int
    worker_env: dict[str, str] | None
    batches: SamplerBatches | None
    seed_globals: bool | str
    stage_slots: int
    assign: str


class DataLoader(_tud.DataLoader[_T_co]):  # type: ignore[misc]  # torch is typed as Any (pyproject's [tool.mypy])
    """``torch.utils.data.DataLoader``, loading with procpipe's engine.

    Accepts torch's arguments with torch's meaning and yields the same batches, in the
    same order (with ``in_order=False``, as they finish). torch validates the arguments
    and builds the samplers; each epoch the index sampler runs in this process and its
    batches go to procpipe's workers. Differences, all documented in the README section
    "PyTorch: procpipe.torch.DataLoader":

    - a map-style dataset's sampler must have a length and yield integer indices (with
      ``batch_size=None``, or lists of them: each list is loaded with one ``dataset[list]``
      call); a dataset's ``__getitems__`` loads each batch in one call, as torch's;
    - an ``IterableDataset`` is iterated as torch does (a replica per worker, round-robin
      with ``in_order``; see ``procpipe.torch.iterable``), except that a worker that dies
      ends the epoch with ``ReplicaLostError`` (its iterator cannot be resumed elsewhere);
    - ``multiprocessing_context=None`` means procpipe's ``"auto"``: ``"fork"`` (torch's
      default) while the process runs no OS thread but its main one and those that ran when
      procpipe was imported (numpy's BLAS pool), else the fork-safe ``"zygote"`` (a copy of
      the process forked at ``import procpipe``), else ``"forkserver"`` (a dataset holding
      ``multiprocessing`` locks or shared values then needs ``"fork"``); resolved for the
      first epoch and kept for later epochs' workers. ``"zygote"`` may be asked for by name;
    - whatever the start method, the dataset and functions reach the workers as the script
      defines them (classes of ``__main__`` or a notebook with their bases, ``Generic`` and
      ``TypeVar``s, dataclasses, enums, closures, lambdas): procpipe ships them with
      cloudpickle (docs/guide/startup.md), where torch's spawn and forkserver need them
      importable from the main script;
    - as torch: batch k of an epoch goes to worker ``k % num_workers`` (``in_order=True``;
      with ``in_order=False``, to the least busy worker), and each worker seeds ``random``
      and torch with ``base_seed + id`` and numpy with torch's derived seed before
      ``worker_init_fn`` (``base_seed`` drawn from ``generator`` as torch draws it), so random
      augmentation draws what it draws under torch's DataLoader. procpipe's alternatives:
      ``assign="balanced"`` (each batch to the least busy worker: a slow batch holds back no
      other) and ``seed_globals=True`` (the global generators re-seeded before every batch from
      ``(seed, epoch, first index)``, or ``"sample"``: before every sample, so augmentation does
      not depend on ``num_workers`` or the schedule, and a resumed epoch draws what the
      original drew);
    - ``prefetch_factor * num_workers`` ready batches are kept ahead (torch counts the same
      total; procpipe also keeps up to two tasks per worker in flight).

    ``state_dict()`` / ``load_state_dict()`` and ``snapshot_every_n_steps`` are torchdata's
    ``StatefulDataLoader``'s (``procpipe.torch.state``; docs/guide/pytorch-resume.md).

    Extra keyword arguments (procpipe's): ``device`` ("cuda[:N]": batches arrive already
    on the GPU, see ``Loader(device=...)``), ``slot_bytes``, ``shm_dir``,
    ``max_worker_restarts``, ``worker_env``, ``assign`` (None: torch's schedule, above),
    ``seed_globals`` (``False``: torch's per-worker seeds), kept as attributes of the same names
    (``procpipe_options()``). ``close()`` ends the workers now. What torch reads when an iterator
    starts (``worker_init_fn``, ``collate_fn``, ``num_workers``...) may be assigned after construction,
    as in torch. Accelerate and the Hugging Face Trainer: ``procpipe.torch.accelerate``,
    ``procpipe.torch.transformers``.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: Any = None,
        slot_bytes: int | None = None,
        shm_dir: str | None = None,
        max_worker_restarts: int = 3,
        worker_env: dict[str, str] | None = None,
        snapshot_every_n_steps: int | None = 1,
        assign: str | None = None,
        seed_globals: bool | str = False,
    ) -> None:
        self._pp_kind_class = dataset_kind(dataset)  # resolved once: the DataLoader asks its kind, never which it is
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            _torch_context(multiprocessing_context),
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        # procpipe's own options, public attributes named as the arguments: what rebuilds a loader from
        # its attributes (Lightning's sampler injection, procpipe.torch.accelerate) passes them on
        self.device = device
        self.slot_bytes = slot_bytes
        self.shm_dir = shm_dir
        self.max_worker_restarts = max_worker_restarts
        self.worker_env = worker_env
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self.assign = assign
        self.seed_globals = seed_globals
        self._pp_context = multiprocessing_context  # as given: procpipe's names ("auto", "zygote") torch refuses
        self._pp_loader: Loader | None = None
        self._pp_current: Loader | None = None  # the loader of the latest iteration (stats())
        self._pp_epoch_loader: weakref.ref[Loader] | None = None  # the running epoch's (persistent_workers=False)
        self._pp_live: weakref.ref[FacadeIterator] | None = None  # persistent workers: the iterator iter() hands back
        self._pp_latest: FacadeIterator | None = None  # an IterableDataset's latest iterator, held (__iter__)
        self._pp_iterated = False
        self._pp_epochs = 0
        self._pp_transfer: CudaTransfer | None = None
        self._pp_state = self._pp_new_state()
        self._pp_configure()

    # ---------------------------------------------------------------- configuration
    def _pp_read(self) -> tuple[Any, ...]:
        """The attributes an iteration reads (torch's iterator reads them when it starts): assigning
        one after construction (Lightning's ``worker_init_fn``) takes effect at the next new iterator."""
        return tuple(getattr(self, name) for name in _READ_AT_ITERATION)

    def _pp_new_state(self) -> FacadeState:
        state = FacadeState(
            dataset=self.dataset,
            iterable=self._pp_kind_class.iterable,
            num_workers=self.num_workers,
            persistent=self.persistent_workers,
            generator=self.generator,
            snapshot_every=FacadeState.check_every(self.snapshot_every_n_steps or 0),
            index_sampler=self._index_sampler,
        )
        weakref.finalize(self, FacadeState.cleanup, state.stores)
        return state

    def _pp_configure(self) -> None:
        """The kind, the start method and the Loader's options, from the attributes as they are now."""
        self._pp_configured = self._pp_read()
        num_workers = self.num_workers
        generator = self.generator
        self._pp_seed = int((generator if generator is not None else torch.default_generator).initial_seed())
        self._pp_kind: DatasetKind = self._pp_kind_class(
            TorchArguments(
                self.dataset,
                self._index_sampler,
                self._auto_collation,
                self.collate_fn,
                self.worker_init_fn,
                num_workers,
                self._pp_seed,
                self.batch_size,
                self.drop_last,
            )
        )
        context = self._pp_context
        if _torch_context(context) is not self.multiprocessing_context:  # assigned since (torch's setter)
            context = self._pp_context = self.multiprocessing_context
        self._pp_start_method = _start_method(context)
        self._pp_device = None if self.device is None else resolve_device(self.device)
        if self._pp_device is not None and self._pp_device.type == "cpu":
            self._pp_device = None  # batches are CPU tensors already
        assign = self.assign
        self._pp_options = _LoaderOptions(
            batch_size=self._pp_kind.batch_size,  # sizes: the batch sampler's
            workers=num_workers,
            ordered=bool(self.in_order),
            prefetch=max(1, (self.prefetch_factor or 0) * num_workers),
            seed=self._pp_seed,
            collate_fn=self._pp_kind.collate_fn,
            start_method=self._pp_start_method,
            shm_dir=self.shm_dir,
            slot_bytes=self.slot_bytes,
            max_worker_restarts=self.max_worker_restarts,
            worker_env=self.worker_env,
            batches=self._pp_kind.batches,
            # torch's per-worker seeds (TorchSource), unless procpipe's reseeding is asked for;
            # like torch, num_workers=0 leaves the generators alone
            seed_globals=self.seed_globals if num_workers > 0 else False,
            # torch's schedule: in order, batch k to worker k % num_workers (IterableDataset
            # replicas are bound to their workers whatever this says)
            assign=assign if assign is not None else ("round_robin" if self.in_order else "balanced"),
            # the CUDA transfer's copies read batches in their slots: the ring gets slots for them
            stage_slots=0 if self._pp_device is None else CudaTransfer.SLOTS_HELD,
        )
        LoaderConfig.from_arguments(**self._pp_options)  # procpipe's arguments checked now, as torch checks its own
        self._pp_state.reconfigure(num_workers, self.generator, self._pp_kind.index_sampler)
        batches = self._pp_kind.batches
        if batches is not None:
            # (the keeper and the sampler, not self: a cycle would keep the workers until the next gc)
            batches.before_draw = functools.partial(self._pp_state.before_draw, self._index_sampler)
            batches.generators = functools.partial(generators_of, self._index_sampler, self.generator)
            batches.ahead = (self.prefetch_factor or 0) * num_workers
            batches.workers = num_workers > 0

    def __copy__(self) -> DataLoader[_T_co]:
        """A shallow copy (``copy.copy``): the same dataset, sampler and options, with an engine of its
        own (closing one never closes the other's workers)."""
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        for name, value in _ENGINE_FREE.items():
            clone.__dict__[name] = value
        clone.__dict__["_pp_state"] = clone._pp_new_state()
        clone._pp_configure()
        return clone

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> FacadeIterator:
        self._pp_latest = None  # (the previous iteration's, if nobody else holds it, ends now)
        reuse = self.persistent_workers and self.num_workers > 0 and self._pp_iterated
        live = self._pp_live() if self._pp_live is not None and reuse else None
        if live is not None:  # torch resets its one iterator and hands it back: the old epoch ends here
            live.end_epoch()
        if not reuse and self._pp_read() != self._pp_configured:
            # an attribute torch reads when an iterator starts was assigned since (worker_init_fn...)
            if self._pp_loader is not None:
                self._pp_loader.close()
                self._pp_loader = None
            self._pp_configure()
        pin = False
        base_seed = 0
        shared_seed: int | None = None  # an IterDataPipe's (torch draws one per iterator)
        kind = self._pp_kind
        datapipe = kind.datapipe
        if not reuse:
            # What torch's iterator does when it is created: the same warnings, and the same
            # draw from the generator (so shuffling stays in step with torch's DataLoader).
            # torch's warnings point into its own iterator's code, one place: the default filter
            # shows each once per process, not once per line of the program that iterates.
            if self.pin_memory and self.pin_memory_device:
                warnings.warn(
                    "pin_memory_device is deprecated, the current accelerator will be used as the "
                    f"device,ignore pin_memory_device='{self.pin_memory_device}'.",
                    stacklevel=1,
                )
            if self.pin_memory and not torch.accelerator.is_available():
                warnings.warn(
                    "'pin_memory' argument is set as true but no accelerator is found, then device "
                    "pinned memory won't be used.",
                    stacklevel=1,
                )
            if datapipe:  # torch: a shared seed for the datapipe's random pipes, then the workers' base seed
                shared_seed = _draw_seed(self.generator)
            base_seed = _draw_seed(self.generator)
            if datapipe and self.num_workers > 0:
                _draw_seed(self.generator)  # torch's first _reset draws a shared seed its workers never see
        elif datapipe:
            _draw_seed(self.generator)  # torch's shared seed of this epoch (the replicas derive theirs)
        self._pp_iterated = True
        base_seed, shared_seed = self._pp_state.begin(self._pp_epochs, base_seed, shared_seed)
        if self.pin_memory and torch.accelerator.is_available():
            accelerator = torch.accelerator.current_accelerator()
            pin = accelerator is not None and accelerator.type != "mps"
        convert = kind.convert
        owned = None
        # num_workers=0: an IterableDataset is iterated here, as torch does; a map-style one by a Loader
        epoch: Iterator[Any] | None = kind.inline_epoch(self._pp_state, shared_seed) if self.num_workers == 0 else None
        if epoch is not None:
            convert = _same
            loader = None
        else:
            batching = kind.plan_epoch(self._pp_loader is not None)
            if batching is not None:  # (batch_size=None: this epoch's sampler items switched kind)
                self._pp_options["batch_size"], self._pp_options["collate_fn"] = batching
            if self.persistent_workers or self.num_workers == 0:
                if self._pp_loader is None:
                    self._pp_loader = self._pp_new_loader(base_seed, shared_seed)
                loader = self._pp_loader
            else:  # like torch: fresh workers (and a fresh copy of the dataset) every epoch
                loader = owned = self._pp_new_loader(base_seed, shared_seed)
                self._pp_epoch_loader = weakref.ref(owned)
            loader.set_epoch(self._pp_epochs)
            if kind.batches is not None:  # (a resumed epoch's pulls go on from its position)
                kind.batches.offset = self._pp_state.returned
            self._pp_state.resume_loader(loader, None)
            self._pp_current = loader
            self._pp_epochs += 1
            epoch = iter(loader)
        stage: Stage | None = None  # a stage keeps its source's state with each batch (state_dict)
        keep = loader is not None
        depth = self._pp_options["prefetch"]
        if self._pp_device is not None:
            if self._pp_transfer is None:
                self._pp_transfer = CudaTransfer(self._pp_device, capacity=depth + 2)
            transfer = self._pp_transfer
            move = on_moved(transfer, convert)
            stage = Stage(
                epoch,
                lambda b: move(b, getattr(epoch, "position", None)),
                depth,
                self.timeout if self.num_workers else None,
                keep_state=keep,
            )
        elif pin:
            from torch.utils.data._utils.pin_memory import pin_memory as _pin

            pin_value = on_value(_pin)
            stage = Stage(
                epoch,
                lambda b: (pin_value(convert(b)), None),
                depth,
                self.timeout if self.num_workers else None,
                keep_state=keep,
            )
        elif self.timeout > 0 and self.num_workers > 0:  # torch ignores timeout without workers
            stage = Stage(epoch, lambda b: (convert(b), None), 0, self.timeout, keep_state=keep)
        self._pp_state.set_stage(stage)
        self._pp_state.started_iteration()
        iterator = FacadeIterator(
            epoch,
            convert,
            stage,
            owned,
            kind.epoch_length(self),  # None: an IterableDataset's (torch's iterator has no len())
            loader,
            self._IterableDataset_len_called,  # (set by len(self) over an IterableDataset: warn past it)
            self.dataset,
            self.num_workers > 0,
            self._pp_state,
            kind.batches if loader is not None else None,
        )
        if kind.iterable and self.num_workers > 0 and is_stateful(self.dataset):
            # as torchdata's StatefulDataLoader holds its iterator: the replicas of `iter(loader)` run
            # (and report their initial states to state_dict()) until the next iter() or close();
            # a dataset with no state to report keeps torch's lifetime (workers end with the iterator)
            self._pp_latest = iterator
        if self.persistent_workers and self.num_workers > 0:
            if live is not None:
                live.adopt(iterator)
                iterator = live
            self._pp_live = weakref.ref(iterator)
        return iterator

    def _pp_new_loader(self, base_seed: int, shared_seed: int | None) -> Loader:
        """The engine: over the dataset, or (IterableDataset) over one replica per worker
        (``shared_seed``: an IterDataPipe's, see ``procpipe.torch.iterable``)."""
        try:
            with spoken_as(_WORDS):  # (a SlowStartWarning says multiprocessing_context too)
                loader = self._pp_kind.new_loader(
                    self._pp_options, base_seed, shared_seed, self._pp_epochs, self._pp_state
                )
        except ShippingError as exc:  # in the words of a DataLoader user, who has no start_method
            raise exc.reworded(words=_WORDS) from None
        # "auto" is resolved once, for the first epoch: later epochs' workers (persistent_workers=False)
        # start the same way, though the training loop runs threads by then (torch forks each epoch too)
        self._pp_options["start_method"] = loader.start_method
        return loader

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration stands, as torchdata's ``StatefulDataLoader.state_dict()``: loaded into
        a DataLoader built the same way, the next ``iter()`` goes on with the next batch (docs:
        docs/guide/pytorch-resume.md; the logic: ``procpipe.torch.state``)."""
        # (a procpipe.torch.state_schema.SavedState, in torch's type)
        return cast("dict[str, Any]", self._pp_state.state_dict(self._pp_seed))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` at the next ``iter()`` (the persistent workers, if any, are
        replaced, as torchdata's are); ``ValueError`` for a state of another kind of DataLoader."""
        self._pp_epochs = self._pp_state.load(state_dict)
        seed = state_dict[PROCPIPE].get(SEED, self._pp_seed)
        if self._pp_loader is not None:
            self._pp_loader.close()
            self._pp_loader = None
        # the next iter() draws as the saved one's successor would (persistent workers: no new seeds)
        self._pp_iterated = bool(state_dict[PROCPIPE].get(FINISHED)) and self.persistent_workers
        if seed != self._pp_seed:  # the per-batch seeds (seed_globals=True) are the saved loader's
            self._pp_seed = self._pp_options["seed"] = seed

    def procpipe_options(self) -> dict[str, Any]:
        """procpipe's own keyword arguments of this DataLoader, and ``multiprocessing_context`` as given
        (procpipe's names, such as ``"zygote"``, which torch's attribute cannot hold): what a DataLoader
        rebuilt from this one's attributes passes on (``procpipe.torch.accelerate``)."""
        return {
            **{name: getattr(self, name) for name in _PROCPIPE_OPTIONS},
            "multiprocessing_context": self._pp_context,
        }

    def stats(self) -> dict[str, Any]:
        """``procpipe.Loader.stats()`` of the engine behind the latest iteration (what
        ``python -m procpipe.bench`` reads); ``RuntimeError`` before the first one."""
        if self._pp_current is None:
            raise RuntimeError("stats() describes an iteration: iterate over the DataLoader first")
        return self._pp_current.stats()

    def close(self) -> None:
        """End the workers and remove the shared memory now (otherwise done when collected),
        those of an epoch still being iterated included."""
        # The CUDA transfer first (as Loader.close): its registrations of the rings end
        # before the rings are unmapped. A later iteration makes a new one (direct copies).
        self._pp_latest = None
        transfer, self._pp_transfer = self._pp_transfer, None
        if transfer is not None:
            transfer.close()
        self._pp_state.close()
        epoch_loader = self._pp_epoch_loader() if self._pp_epoch_loader is not None else None
        if epoch_loader is not None:
            epoch_loader.close()
        if self._pp_loader is not None:
            self._pp_loader.close()
            self._pp_loader = None

    @property
    def start_method(self) -> str:
        """How the workers start: ``"fork"``, ``"forkserver"`` or ``"spawn"`` once the first
        iteration has created the engine (``"auto"`` is resolved then, and kept for every later
        epoch: ``procpipe.Loader.start_method``); until then, the method asked for."""
        return self._pp_options["start_method"]

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the persistent workers (empty before the first epoch or without them)."""
        return [] if self._pp_loader is None else self._pp_loader.worker_pids


# What torch's iterator reads from the DataLoader when it starts (and procpipe's own options): a
# new value assigned after construction is used by the next iterator that starts workers.
_READ_AT_ITERATION = (
    "num_workers",
    "collate_fn",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "in_order",
    "device",
    "slot_bytes",
    "shm_dir",
    "max_worker_restarts",
    "worker_env",
    "assign",
    "seed_globals",
)
# procpipe's own arguments, kept as public attributes of the same names
_PROCPIPE_OPTIONS = (
    "device",
    "slot_bytes",
    "shm_dir",
    "max_worker_restarts",
    "worker_env",
    "snapshot_every_n_steps",
    "assign",
    "seed_globals",
)
# A shallow copy's engine: none yet (copy.copy must not share the original's workers)
_ENGINE_FREE: dict[str, Any] = {
    "_pp_loader": None,
    "_pp_current": None,
    "_pp_epoch_loader": None,
    "_pp_live": None,
    "_pp_latest": None,
    "_pp_transfer": None,
    "_pp_iterated": False,
}


def _same(batch: Any) -> Any:
    return batch


def _draw_seed(generator: torch.Generator | None) -> int:
    """A seed drawn from the loader's generator as torch's iterator draws its seeds."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
