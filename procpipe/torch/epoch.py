"""One epoch of a ``procpipe.torch.DataLoader``: the iterator ``iter(loader)`` returns.

It takes batches from the device stage (``procpipe.torch.device.Stage``) or the epoch's
source directly, converts them (``procpipe.torch.kinds``: the kind's ``convert``), tells the
facade's state what it returned (``procpipe.torch.state``), and closes a per-epoch Loader at
the end. Over an ``IterableDataset`` it also does what torch's iterator does: no ``len()``,
a replica's error raised in its batch's place, torch's warning past the ``len()`` reported.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ..loader import Loader
from .device import Stage
from .iterable import RaisedInReplica, reraise
from .sampling import SamplerBatches
from .snapshots import ReplicaEnded
from .state import FacadeState

__all__ = ["FacadeIterator"]


def _taken_over() -> dict[str, Any]:
    """What an iterator whose epoch another took over holds: nothing to close, nothing to tell."""
    return {"_stage": None, "_owned": None, "_state": None, "_draws": None, "_loader": None}


class FacadeIterator:
    """One epoch of a ``procpipe.torch.DataLoader``."""

    def __init__(
        self,
        epoch: Iterator[Any],
        convert: Callable[[Any], Any],
        stage: Stage | None,
        owned: Loader | None,
        length: int | None,
        loader: Loader | None,
        len_called: int | None = None,
        dataset: Any = None,
        with_workers: bool = False,
        state: FacadeState | None = None,
        draws: SamplerBatches | None = None,
    ) -> None:
        self._epoch = epoch
        self._convert = convert
        self._stage = stage
        self._owned = owned  # a per-epoch Loader (persistent_workers=False), closed at the end
        self._length = length  # None: an IterableDataset's (no len(), as torch's)
        self._len_called = len_called  # an IterableDataset's len() if len(loader) was asked: warn past it
        self._dataset = dataset
        self._with_workers = with_workers
        self._yielded = 0
        self._loader = loader  # None: an IterableDataset iterated in this process
        self._state = state  # the DataLoader's state_dict keeper: told what is returned
        self._draws = draws  # a map-style epoch's sampler items: the generators follow the batches returned
        self._returned = 0

    @property
    def _workers(self) -> list[Any]:
        """The worker processes (``multiprocess.Process``), as torch's iterator's ``_workers``
        (code that reaches into it: ``pid``, ``is_alive()``, ``join()``). Empty once closed."""
        return [] if self._loader is None else self._loader.worker_processes

    def __iter__(self) -> FacadeIterator:
        return self

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(
                "an iterator over an IterableDataset has no len() (as torch's); len(loader) "
                "gives the length the dataset reports"
            )
        return self._length

    def __next__(self) -> Any:
        if self._draws is not None:
            self._draws.pulling(self._returned)
        while True:
            try:
                batch = next(self._stage) if self._stage is not None else self._convert(next(self._epoch))
            except StopIteration:
                self._finish()
                if self._draws is not None:
                    self._draws.ended()
                    self._draws = None
                if self._state is not None:
                    self._state.finished()
                raise
            if self._state is None or type(batch := self._state.received(batch)) is not ReplicaEnded:
                break
        if self._draws is not None:
            self._returned += 1
            self._draws.returned(self._returned)
        if self._length is None:
            if type(batch) is RaisedInReplica:  # an error in a replica, in the place of its batch
                reraise(batch)
            self._counted()
        return batch

    def _counted(self) -> None:
        """torch's check (and message, which code may filter on): more batches than the dataset's len()."""
        self._yielded += 1
        if self._len_called is not None and self._yielded > self._len_called:
            message = (
                f"Length of IterableDataset {self._dataset} was reported to be {self._len_called}"
                f"(when accessing len(dataloader)), but {self._yielded} samples have been fetched. "
            )
            if self._with_workers:
                message += (
                    "For multiprocessing data-loading, this could be caused by not properly configuring "
                    "the IterableDataset replica at each worker (shard it in __iter__ with "
                    "torch.utils.data.get_worker_info())."
                )
            warnings.warn(message, stacklevel=3)

    def end_epoch(self) -> None:
        """A new epoch of the same persistent workers begins (``iter(loader)`` again): this one's stage
        and position are let go now, before the new one starts (``adopt`` follows)."""
        self._finish()

    def adopt(self, other: FacadeIterator) -> None:
        """Become ``other`` (the new epoch's iterator), as torch's one iterator of persistent workers is
        reset and handed back by ``iter(loader)``: code holding this object reads the new epoch."""
        self.__dict__.update(other.__dict__)
        other.__dict__.update(_taken_over())

    def _finish(self) -> None:
        if self._state is not None:
            self._state.closing()  # (before the stage or the loader closes)
        if self._stage is not None:
            self._stage.close()
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def __del__(self) -> None:
        try:
            self._finish()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass
