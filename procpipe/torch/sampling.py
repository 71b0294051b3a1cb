"""A map-style dataset in the torch facade: what its workers load, and each epoch's batches.

- ``TorchSource`` wraps the dataset for the core, in the worker: torch's per-worker set-up
  (``get_worker_info()``, seeds, ``worker_init_fn``) once per process, each sample turned
  into what its collate mode needs (``procpipe.torch.tensor_batches``).
- ``SamplerBatches`` is the core's ``batches=``: one epoch of the torch (batch) sampler,
  drawn in the training process, including ``batch_size=None``'s lists of indices
  (bulk loading: ``BulkFetch`` calls ``dataset[list]`` once per item).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from typing import Any

import dill
import torch.utils.data as _tud

from .._ext import collate_privately, reseed_current_sample, worker_index
from .draws import PullStates
from .snapshots import Tagged
from .tensor_batches import InProcess, Keyed, Packed, pack_for_consumer, sample_to_wire, unpack
from .worker_setup import become_torch_worker

__all__ = [
    "BULK",
    "CUSTOM",
    "DEFAULT",
    "UNBATCHED",
    "BatchedFetch",
    "BulkFetch",
    "SamplerBatches",
    "SnapshotConvert",
    "SnapshottingCollate",
    "TorchSource",
    "fetches_batches",
]

_UNKNOWN_LENGTH = 1 << 62  # a map-style dataset without __len__ (allowed with a custom sampler)


def _none_sample_error(index: Any) -> TypeError:
    """A map-style sample that is ``None`` under the default collate (the facade's message)."""
    return TypeError(
        f"the dataset's __getitem__ returned None for index {index}: a sample must be a value (a tensor, an "
        "array, a number, a dict or tuple of them); did __getitem__ forget a `return`? (To batch None values "
        "on purpose, pass a collate_fn that handles them.)"
    )


# ---- the dataset, as the workers see it -----------------------------------------------
# BULK: batch_size=None with a sampler yielding lists of indices: dataset[list] per item.
DEFAULT, CUSTOM, UNBATCHED, BULK = "default", "custom", "unbatched", "bulk"


class TorchSource:
    """Wraps a map-style dataset for the core: worker set-up, seeding, conversion.

    A worker process first does what torch's worker loop does: ``random`` and torch seeded
    with ``base_seed + id``, numpy with torch's seed derived from both, ``get_worker_info()``
    set, then ``worker_init_fn(id)``. ``base_seed`` is the facade's draw from the generator
    when the iterator (the workers) starts. With the facade's ``seed_globals=True`` the core
    then also seeds the global generators before each batch from ``(seed, epoch, its first
    index)`` (``procpipe._core.rng``), so augmentation does not depend on ``num_workers`` or
    the schedule.
    """

    def __init__(
        self,
        dataset: Any,
        mode: str,
        item_fn: Callable[[Any], Any] | None,
        worker_init_fn: Callable[[int], Any] | None,
        num_workers: int,
        base_seed: int,
    ) -> None:
        self.dataset = dataset
        self.mode = mode
        self.item_fn = item_fn  # collate_fn applied to each sample (batch_size=None + collate_fn)
        self.worker_init_fn = worker_init_fn
        self.num_workers = num_workers
        self.base_seed = base_seed  # the per-worker seeds': each iterator's draw, set by the facade (kinds.py)
        self.fetch_batches = False  # the dataset's __getitems__ loads each batch (BatchedFetch)
        # a Stateful dataset's state per worker (dill bytes), loaded by that worker as it starts: a
        # resumed epoch's workers go on from the states of the batches returned (torchdata's)
        self.worker_states: dict[int, bytes] = {}
        self.snapshots = False  # batch_size=None: each sample leaves with the state (SnapshottingCollate)
        try:
            self.length = len(dataset)
        except TypeError:
            self.length = _UNKNOWN_LENGTH
        self._pid: int | None = None
        self._in_worker = False

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pid"] = None
        return state

    def _enter_process(self) -> None:
        self._pid = os.getpid()
        worker_id = worker_index()
        self._in_worker = worker_id is not None
        if worker_id is None:
            return  # num_workers=0: like torch, the main process's generators are left alone
        become_torch_worker(self.base_seed, worker_id, self.num_workers, self.dataset)
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)
        state = self.worker_states.get(worker_id)
        if state is not None:  # torchdata's order: seeds, worker_init_fn, then the dataset's state
            self.dataset.load_state_dict(dill.loads(state))

    def __getitem__(self, index: int) -> Any:
        if self._pid != os.getpid():
            self._enter_process()
            reseed_current_sample()  # the per-worker set-up above re-seeded the generators
        if self.mode == BULK or self.fetch_batches:
            return index  # BulkFetch / BatchedFetch loads the whole list at once
        sample = self.dataset[index]
        if self.mode == DEFAULT:
            if sample is None:
                raise _none_sample_error(index)
            return sample_to_wire(sample)
        if self.mode == UNBATCHED:
            item = sample if self.item_fn is None else self.item_fn(sample)
            worker = worker_index()
            if self.snapshots and worker is not None:  # with its worker's dataset state (SnapshottingCollate)
                item = Tagged(item, worker, -1, -1, _dataset_state(self.dataset))
            return pack_for_consumer(item, [Keyed(index, sample)])  # (a value it cannot send names its index)
        return Keyed(index, sample)  # CUSTOM: the collate_fn gets the samples as the dataset made them (PackingCollate)


class BulkFetch:
    """``collate_fn`` for the core in ``BULK`` mode, run in the worker: ``dataset[indices]``
    (the sampler's item, a list) in one call, then the user's ``collate_fn``, if any."""

    def __init__(self, source: TorchSource) -> None:
        self.source = source

    def __call__(self, indices: list[Any]) -> Packed | InProcess:
        source = self.source
        data = source.dataset[list(indices)]
        return pack_for_consumer(data if source.item_fn is None else source.item_fn(data))


def fetches_batches(dataset: Any) -> bool:
    """Whether torch's fetcher loads a batch of ``dataset`` with one ``__getitems__`` call (as torch
    asks: the attribute is there and true). A ``Subset`` of a dataset without one counts as without:
    its ``__getitems__`` is then the very per-index loop (torch's ``Subset``)."""
    if not getattr(dataset, "__getitems__", None):
        return False
    if type(dataset) is _tud.Subset:
        return fetches_batches(dataset.dataset)
    return True


class BatchedFetch:
    """``collate_fn`` for the core when the dataset has ``__getitems__``, run in the worker: one
    ``dataset.__getitems__(indices)`` call per batch, as torch's fetcher makes it, then the batch:

    - default collate: each sample as the core stacks it (``sample_to_wire``), stacked here into new
      arrays (the consumer rebuilds ``default_collate``'s batch from them, ``from_default``);
    - a ``collate_fn``: its result, packed (its tensors through the ring, ``unpack``).
    """

    def __init__(self, source: TorchSource, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.source = source
        self.collate_fn = collate_fn  # None: default collate

    def __call__(self, indices: list[Any]) -> Any:
        samples = self.source.dataset.__getitems__(list(indices))
        if self.collate_fn is not None:
            return pack_for_consumer(self.collate_fn(samples))
        wire = []
        for index, sample in zip(indices, samples, strict=True):
            if sample is None:
                raise _none_sample_error(index)
            wire.append(sample_to_wire(sample))
        return collate_privately(None, wire, list(indices))


class SnapshottingCollate:
    """``collate_fn`` for the core over a ``Stateful`` map-style dataset with workers, run in the
    worker: the batch (``inner``'s, or the default stacking into new arrays), then the dataset's
    ``state_dict()`` taken right after it, sent with it as a ``Tagged`` record
    (``procpipe.torch.snapshots``). After every batch, whatever ``snapshot_every_n_steps`` says:
    a map-style worker cannot make its batches again to reach a later point (torchdata's
    fast-forward), so an exact resume needs the state of the very batch returned last. The consumer keeps, per worker,
    the state of the last batch it returned (torchdata's worker snapshots), so a resumed epoch's
    workers go on where the returned batches left them, random generators in the state included."""

    def __init__(self, source: TorchSource, inner: Callable[[list[Any]], Any] | None) -> None:
        self.source = source
        self.inner = inner

    def __call__(self, samples: list[Any]) -> Packed | InProcess:
        if self.inner is not None:
            value = self.inner(samples)
        else:
            value = collate_privately(None, samples, list(range(len(samples))))
        worker = worker_index()
        state = None if worker is None else _dataset_state(self.source.dataset)
        return pack_for_consumer(Tagged(value, -1 if worker is None else worker, -1, -1, state))


def _dataset_state(dataset: Any) -> bytes:
    """A Stateful dataset's state, taken now (in a worker), as it travels to the consumer."""
    return dill.dumps(dataset.state_dict(), protocol=dill.HIGHEST_PROTOCOL)


class SnapshotConvert:
    """The consumer's side of ``SnapshottingCollate``: the ``Tagged`` record, its batch converted
    as the dataset's kind converts batches (the facade's state unwraps it when it is returned)."""

    def __init__(self, convert: Callable[[Any], Any]) -> None:
        self.convert = convert

    def __call__(self, packed: Any) -> Any:
        record = unpack(packed)
        record.value = self.convert(record.value)
        return record


def _is_index(item: Any) -> bool:
    try:
        operator.index(item)
    except TypeError:
        return False
    return True


class SamplerBatches:
    """``batches=`` for the core: one epoch of a torch (batch) sampler, materialized.

    Without auto-batching (``batch_size=None``) a sampler item is either one index or,
    as torch allows, a list of indices the dataset loads at once ("bulk loading"):
    ``_plan()`` draws the epoch's items before the loader starts and says which.
    """

    def __init__(self, index_sampler: Any, unbatched: bool) -> None:
        self.index_sampler = index_sampler
        self.unbatched = unbatched
        self.bulk = False
        self._planned: list[Any] | None = None
        self.before_draw: Callable[[], None] | None = None  # the facade's state, told before each draw
        self.generators: Callable[[], list[Any]] = list  # the facade's: the generators the draw may use
        self.ahead = 0  # the items torch's iterator pulls when it starts (prefetch_factor * num_workers)
        self.workers = False  # without workers torch pulls an item as next() begins, before loading it
        self.offset = 0  # batches returned before this iteration began (a resumed epoch's)
        self.pulls = PullStates()  # the generators' states along the draw (procpipe.torch.draws)

    def _draw(self) -> list[Any]:
        if self.before_draw is not None:
            self.before_draw()
        items = self.pulls.draw(self.index_sampler, self.generators())
        # where torch's generators stand once its iterator has started (a resumed epoch: at its position)
        self.pulls.advance(self.offset + (self.ahead if self.workers else 0))
        return items

    def pulling(self, batches: int) -> None:
        """The epoch's iterator begins ``next()`` after ``batches`` batches (without workers torch pulls
        the next item now, before loading its batch)."""
        if not self.workers:
            self.pulls.advance(self.offset + batches + 1)

    def returned(self, batches: int) -> None:
        """The epoch's iterator has returned ``batches`` batches (with workers torch pulls one more item
        after each): the generators stand where torch's do."""
        if self.workers:
            self.pulls.advance(self.offset + self.ahead + batches)

    def ended(self) -> None:
        """The epoch ended: the generators stand where a full pull leaves them."""
        self.pulls.finish()

    def __len__(self) -> int:
        return len(self.index_sampler)

    def plan(self) -> bool:
        """Draw the next epoch's items from the sampler now (the next call returns them);
        whether they are lists of indices (bulk loading)."""
        self._planned = items = self._draw()
        return bool(items) and not _is_index(items[0])

    def __call__(self, epoch: int) -> list[list[Any]]:
        items, self._planned = self._planned, None
        if items is None:
            items = self._draw()
        if not self.unbatched:
            return [list(batch) for batch in items]
        if not self.bulk:
            return [[index] for index in items]
        out = []
        for position, item in enumerate(items):
            if _is_index(item) or not all(_is_index(i) for i in item):
                raise TypeError(
                    f"the sampler yielded {item!r} (item {position}) after lists of indices: with "
                    "batch_size=None, procpipe.torch.DataLoader takes a sampler yielding integer indices, "
                    "or one yielding lists of integer indices (each list is passed to dataset[...] at once), "
                    "not a mix"
                )
            out.append(list(item))
        return out
