"""Hugging Face Accelerate with procpipe's loader: ``procpipe.torch.accelerate.Accelerator``.

``accelerator.prepare(..., loader)`` does not keep the loader it is given: Accelerate's
``prepare_data_loader`` reads the loader's attributes (dataset, batch sampler, ``num_workers``,
``collate_fn``...) and builds a new one, a ``DataLoaderShard`` (or ``DataLoaderDispatcher``)
around a ``torch.utils.data.DataLoader`` (torchdata's ``StatefulDataLoader`` with
``use_stateful_dataloader=True``) that it constructs by name: no attribute of the loader, no
argument of ``prepare()`` and no setting of ``DataLoaderConfiguration`` chooses that class. So a
``procpipe.torch.DataLoader`` passed to an unmodified ``Accelerator.prepare()`` comes back as
torch's loader, with torch's workers (and procpipe's own options dropped); the only ways to
change that inside ``prepare()`` are patching Accelerate's module or its classes, which this
adapter does not do.

Instead, one line changes: the import of ``Accelerator``::

    from procpipe.torch.accelerate import Accelerator   # was: from accelerate import Accelerator

This ``Accelerator`` is Accelerate's, with ``prepare_data_loader`` (what ``prepare()`` calls for
a loader) and ``skip_first_batches`` letting Accelerate do all its work (sharding per process with
``BatchSamplerShard`` or ``IterableDatasetShard``, ``split_batches``, ``even_batches``, the seedable
sampler, device placement, the synchronized generator), then putting a ``procpipe.torch.DataLoader``
in place of the torch loader Accelerate built inside its wrapper: the same dataset, the same sharded
sampler and torch arguments, and the procpipe options of the loader that was prepared. The batches
come from procpipe's workers; ``state_dict()`` / ``load_state_dict()`` (``save_state`` /
``load_state`` with ``use_stateful_dataloader=True``) are the facade's. A loader that is not
procpipe's is prepared exactly as Accelerate prepares it.

``procpipe_backed(prepared, options)`` is the step itself, for code that holds an Accelerate-prepared
loader (the Hugging Face ``Trainer``: ``procpipe.torch.transformers``).
"""

from __future__ import annotations

from typing import Any

import accelerate
import torch.utils.data as _tud

from . import DataLoader

__all__ = ["Accelerator", "procpipe_backed", "rebuilt"]

# torch's DataLoader arguments a loader keeps as attributes of the same name (besides the dataset,
# the samplers, batch_size and drop_last, chosen below)
_TORCH_OPTIONS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def rebuilt(torch_loader: _tud.DataLoader, options: dict[str, Any]) -> DataLoader:
    """A ``procpipe.torch.DataLoader`` over what ``torch_loader`` reads (its dataset, sampler or batch
    sampler, batch size and torch options), with procpipe's ``options`` (``DataLoader.procpipe_options()``)."""
    kwargs: dict[str, Any] = {name: getattr(torch_loader, name) for name in _TORCH_OPTIONS}
    if isinstance(torch_loader.dataset, _tud.IterableDataset):
        kwargs.update(batch_size=torch_loader.batch_size, drop_last=torch_loader.drop_last)
    elif torch_loader.batch_size is None and torch_loader.batch_sampler is not None:
        kwargs["batch_sampler"] = torch_loader.batch_sampler  # (torch's own sampler beside it is a default)
    else:
        kwargs.update(
            sampler=torch_loader.sampler, batch_size=torch_loader.batch_size, drop_last=torch_loader.drop_last
        )
    given = dict(options)
    if kwargs["multiprocessing_context"] is None and "multiprocessing_context" in given:
        kwargs["multiprocessing_context"] = given["multiprocessing_context"]  # procpipe's names ("zygote")
    given.pop("multiprocessing_context", None)
    return DataLoader(torch_loader.dataset, **kwargs, **given)


def procpipe_backed(prepared: Any, options: dict[str, Any]) -> Any:
    """``prepared`` (what Accelerate's ``prepare_data_loader`` or ``skip_first_batches`` returned)
    loading through procpipe: the torch loader inside Accelerate's wrapper replaced by a
    ``procpipe.torch.DataLoader`` built from it with ``options``; a plain torch loader (Accelerate
    returns one from ``skip_first_batches`` of an unprepared loader) replaced as a whole."""
    base = getattr(prepared, "base_dataloader", None)  # DataLoaderShard, DataLoaderDispatcher, SkipDataLoader
    if base is None:
        if type(prepared) is _tud.DataLoader:
            return rebuilt(prepared, options)
        return prepared  # (XLA's MpDeviceLoaderWrapper, or already procpipe's)
    if isinstance(base, DataLoader):
        return prepared
    loader = rebuilt(base, options)
    prepared.base_dataloader = loader
    if hasattr(prepared, "dl_state_dict"):  # what Accelerate's state_dict() returns until the first batch
        prepared.dl_state_dict = loader.state_dict()
    return prepared


def _options_of(loader: Any) -> dict[str, Any] | None:
    """The procpipe options of ``loader``, or of the loader inside Accelerate's wrapper (whose
    ``__class__`` is its inner loader's); None if it loads through torch."""
    inner = vars(loader).get("base_dataloader") if hasattr(loader, "__dict__") else None
    if inner is not None:
        loader = inner
    return loader.procpipe_options() if isinstance(loader, DataLoader) else None


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose prepared loaders load through procpipe (module docstring)."""

    def prepare_data_loader(
        self, data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        prepared = super().prepare_data_loader(
            data_loader, device_placement=device_placement, slice_fn_for_dispatch=slice_fn_for_dispatch
        )
        options = _options_of(data_loader)
        if prepared is data_loader or options is None:
            return prepared
        backed = procpipe_backed(prepared, options)
        if backed is not prepared:
            self._dataloaders[self._dataloaders.index(prepared)] = backed
        return backed

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        skipped = super().skip_first_batches(dataloader, num_batches=num_batches)
        options = _options_of(dataloader)
        return skipped if options is None else procpipe_backed(skipped, options)
