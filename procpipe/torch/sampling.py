"""A map-style dataset in the torch facade: what its workers load, and each epoch's batches.

- ``TorchSource`` wraps the dataset for the core, in the worker: torch's per-worker set-up
  (``get_worker_info()``, seeds, ``worker_init_fn``) once per process, each sample turned
  into what its collate mode needs (``procpipe.torch.collate``).
- ``SamplerBatches`` is the core's ``batches=``: one epoch of the torch (batch) sampler,
  drawn in the training process, including ``batch_size=None``'s lists of indices
  (bulk loading: ``BulkFetch`` calls ``dataset[list]`` once per item).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from typing import Any

from .._core.rng import reseed_current_sample
from .._worker.identity import worker_index
from .collate import InProcess, Keyed, Packed, pack_for_consumer, sample_to_wire
from .worker_setup import become_torch_worker

__all__ = ["BULK", "CUSTOM", "DEFAULT", "UNBATCHED", "BulkFetch", "SamplerBatches", "TorchSource"]

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

    def __getitem__(self, index: int) -> Any:
        if self._pid != os.getpid():
            self._enter_process()
            reseed_current_sample()  # the per-worker set-up above re-seeded the generators
        if self.mode == BULK:
            return index  # BulkFetch loads the whole list at once
        sample = self.dataset[index]
        if self.mode == DEFAULT:
            if sample is None:
                raise _none_sample_error(index)
            return sample_to_wire(sample)
        if self.mode == UNBATCHED:
            return pack_for_consumer(sample if self.item_fn is None else self.item_fn(sample), [Keyed(index, sample)])
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

    def _draw(self) -> list[Any]:
        if self.before_draw is not None:
            self.before_draw()
        return list(self.index_sampler)

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
