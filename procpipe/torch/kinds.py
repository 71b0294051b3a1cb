"""The two kinds of dataset the torch facade loads, each a small strategy resolved once.

``procpipe.torch.DataLoader`` asks ``dataset_kind(dataset)`` once, before torch checks its
arguments, and builds the answer after (it needs torch's index sampler). From then on it
asks its kind wherever a map-style dataset and an ``IterableDataset`` differ, instead of
testing which one it has (``MapStyle`` / ``IterableStyle``):

- the Loader's source: ``TorchSource`` over the dataset (``procpipe.torch.sampling``) /
  ``Replicas``, a replica per worker (``procpipe.torch.iterable``);
- each epoch's batches: the torch sampler's, drawn here (``SamplerBatches``) / what each
  replica yields;
- collated: by the core (default collate) or by ``collate_fn`` in the worker / in the
  replica, in the worker;
- ``num_workers=0``: a Loader without workers / iterated in this process, as torch does;
- an epoch iterator's ``len()``: the loader's / none (torch's iterator has none either).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any, NamedTuple

import torch.utils.data as _tud

from ..loader import Loader
from .iterable import Replicas, ReplicaSpec, in_process, sharding_init
from .sampling import (
    BULK,
    CUSTOM,
    DEFAULT,
    UNBATCHED,
    BatchedFetch,
    BulkFetch,
    SamplerBatches,
    SnapshotConvert,
    SnapshottingCollate,
    TorchSource,
    fetches_batches,
)
from .snapshots import is_stateful
from .state import FacadeState
from .tensor_batches import PackingCollate, from_default, pack, unpack, unpack_convert

__all__ = ["BatchOptions", "DatasetKind", "IterableStyle", "MapStyle", "TorchArguments", "dataset_kind"]


class BatchOptions(NamedTuple):
    """The Loader's ``batch_size`` and ``collate_fn`` for an epoch, where planning it changed them."""

    batch_size: int | None
    collate_fn: Callable[[list[Any]], Any] | None


class TorchArguments(NamedTuple):
    """What the facade takes from ``torch.utils.data.DataLoader`` once torch has checked its
    arguments: the dataset, the index sampler torch built, whether it collates batches
    (``auto_collation``), the ``collate_fn`` it settled on, and the options either kind reads.
    Both kinds are built from it (``MapStyle(torch_args)``, ``IterableStyle(torch_args)``)."""

    dataset: Any
    index_sampler: Any
    auto_collation: bool
    collate_fn: Callable[[Any], Any]
    worker_init_fn: Callable[[int], Any] | None
    num_workers: int
    seed: int
    batch_size: int | None
    drop_last: bool


class MapStyle:
    """A map-style dataset (``__getitem__``): the sampler's batches of indices go to the workers,
    each sample through ``TorchSource``; the Loader's options ask for one sampler item per batch."""

    iterable = False
    datapipe = False  # (only an IterableDataset can be an IterDataPipe)

    def __init__(self, torch_args: TorchArguments) -> None:
        dataset, index_sampler, collate_fn = torch_args.dataset, torch_args.index_sampler, torch_args.collate_fn
        try:
            len(index_sampler)
        except TypeError:
            raise TypeError(
                "procpipe.torch.DataLoader needs a sampler with a length (each epoch's batches are planned "
                f"when it starts); {type(index_sampler).__name__} has no __len__"
            ) from None
        self.convert: Callable[[Any], Any]  # a batch as the consumer gets it, from what the engine delivers
        default = collate_fn is _tud.default_convert
        if not torch_args.auto_collation:  # collate_fn (default: default_convert) applies to each sample
            mode, item_fn = UNBATCHED, (None if default else collate_fn)
            self.convert = unpack_convert if default else unpack
        elif collate_fn is _tud.default_collate:
            mode, item_fn, self.convert = DEFAULT, None, from_default
        else:
            mode, item_fn, self.convert = CUSTOM, None, unpack
        self.source = TorchSource(
            dataset, mode, item_fn, torch_args.worker_init_fn, torch_args.num_workers, torch_args.seed
        )  # (its base_seed until new_loader sets this iterator's)
        self.index_sampler = index_sampler
        self.batches: SamplerBatches | None = SamplerBatches(index_sampler, mode == UNBATCHED)
        self.batch_size: int | None = None if mode == UNBATCHED else 1  # the Loader's: sizes are the sampler's
        self.collate_fn: Callable[[list[Any]], Any] | None = PackingCollate(collate_fn) if mode == CUSTOM else None
        if mode in (DEFAULT, CUSTOM) and fetches_batches(dataset):  # torch: one __getitems__ call per batch
            self.source.fetch_batches = True
            self.collate_fn = BatchedFetch(self.source, collate_fn if mode == CUSTOM else None)
        if torch_args.num_workers > 0 and is_stateful(dataset):
            # torchdata's worker snapshots: the dataset's state taken in the worker after each batch
            if mode == UNBATCHED:  # (each sample is a batch: TorchSource tags it)
                self.source.snapshots = True
                self.convert = SnapshotConvert(_tud.default_convert if default else _same)
            else:
                self.collate_fn = SnapshottingCollate(self.source, self.collate_fn)
                self.convert = SnapshotConvert(self.convert)
        self.bulk_collate = BulkFetch(self.source)

    def inline_epoch(self, state: FacadeState, shared_seed: int | None) -> Iterator[Any] | None:
        """``num_workers=0``: None, a Loader without workers reads the dataset."""
        return None

    def plan_epoch(self, persistent_loader: bool) -> BatchOptions | None:
        """Before an epoch's Loader iterates. ``batch_size=None``: draw the epoch's sampler items,
        and load each as one index or, for lists of indices, as one ``dataset[list]`` call (a
        loader's workers do one or the other). Returns the Loader's new ``batch_size`` and
        ``collate_fn`` when that changes, else None."""
        source, batches = self.source, self.batches
        if source.mode not in (UNBATCHED, BULK) or batches is None:
            return None
        bulk = batches.plan()
        if bulk == (source.mode == BULK):
            return None
        if persistent_loader:
            raise TypeError(
                "the sampler switched between yielding indices and lists of indices; the workers of a "
                "persistent procpipe.torch.DataLoader load one kind: create a new DataLoader"
            )
        batches.bulk = bulk
        source.mode = BULK if bulk else UNBATCHED
        return BatchOptions(1, self.bulk_collate) if bulk else BatchOptions(None, None)

    def new_loader(
        self, options: Mapping[str, Any], base_seed: int, shared_seed: int | None, epoch: int, state: FacadeState
    ) -> Loader:
        """The engine over the dataset; its workers seed as torch's do, from ``base_seed``
        (this iterator's draw from the generator, or a resumed state's)."""
        self.source.base_seed = base_seed
        self.source.worker_states = state.worker_states(epoch)
        return Loader(self.source, **options)

    def epoch_length(self, loader: Sized) -> int | None:
        """An epoch iterator's ``len()``: the DataLoader's."""
        return len(loader)


class IterableStyle:
    """An ``IterableDataset``: one replica per worker, each a shard of a streaming source
    that collates and packs its own batches (``procpipe.torch.iterable``)."""

    iterable = True
    index_sampler = None  # (torch's endless one: nothing to plan or save)
    batches = None
    batch_size = None  # the replicas batch
    collate_fn = None
    convert = staticmethod(unpack)

    def __init__(self, torch_args: TorchArguments) -> None:
        self.dataset = dataset = torch_args.dataset
        self.datapipe = isinstance(dataset, _tud.IterDataPipe)
        self.replica_collate = torch_args.collate_fn
        self.worker_init_fn = torch_args.worker_init_fn
        self.num_workers = torch_args.num_workers
        self.replica_batch_size = torch_args.batch_size if torch_args.auto_collation else None
        self.drop_last = torch_args.drop_last

    def inline_epoch(self, state: FacadeState, shared_seed: int | None) -> Iterator[Any] | None:
        """``num_workers=0``: the dataset iterated in this process, as torch does (errors in its
        ``__iter__`` raise now), resumed from a loaded state if any."""
        dataset = in_process(self.dataset, shared_seed)
        return state.in_process(dataset, self.replica_batch_size, self.drop_last, self.replica_collate)

    def plan_epoch(self, persistent_loader: bool) -> BatchOptions | None:
        """Nothing to plan: each replica reads its own."""
        return None

    def new_loader(
        self, options: Mapping[str, Any], base_seed: int, shared_seed: int | None, epoch: int, state: FacadeState
    ) -> Loader:
        """The engine over one replica per worker (``shared_seed``: an IterDataPipe's), starting
        at ``epoch`` (a loaded state's replicas resume from their snapshots)."""
        init = self.worker_init_fn if shared_seed is None else sharding_init(self.worker_init_fn)
        source = Replicas(
            ReplicaSpec(
                self.dataset,
                self.num_workers,
                base_seed,
                init,
                self.replica_batch_size,
                self.drop_last,
                self.replica_collate,
                pack,
                shared_seed,
                epoch,
                **state.replica_options(epoch),
            )
        )
        # torch's seeds per worker, then the replica's own draws: no per-record reseeding
        return Loader(source, **{**options, "seed_globals": False})

    def epoch_length(self, loader: Sized) -> int | None:
        """None: an iterator over an IterableDataset has no ``len()``."""
        return None


def _same(value: Any) -> Any:
    return value


DatasetKind = MapStyle | IterableStyle


def dataset_kind(dataset: Any) -> type[MapStyle | IterableStyle]:
    """Which kind ``dataset`` is (the one place that asks); ``TypeError`` if it is neither."""
    if isinstance(dataset, _tud.IterableDataset):
        return IterableStyle
    if not hasattr(dataset, "__getitem__"):
        raise TypeError(f"dataset must support indexing (__getitem__); got {type(dataset).__name__}")
    return MapStyle
