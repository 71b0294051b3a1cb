"""The prefetch/device stage of ``Loader(device=...)`` (needs ``torch``): which node, for which device.

Where it sits in the data path: coordinator -> worker -> ring slot -> reassembly ->
**prefetch/device stage** -> consumer. It takes each batch the epoch iterator yields
(numpy views of a ring slot) and hands the consumer torch tensors. ``TorchDeviceStage`` (made
once per loader) builds it from three modules, one job each:

- ``"cpu"``: procpipe/torch/convert.py: ``to_torch`` (tensors sharing the ring's memory,
  no copy), then ``device_fn``, in a ``Mapped`` node: no thread;
- ``"cuda[:N]"``: procpipe/torch/cuda_transfer.py: ``CudaTransfer`` (the copy to the GPU from
  the registered ring, or through pinned staging, on the transfer's own stream, then
  ``device_fn``), run ahead of the consumer in a ``Prefetcher`` thread;
- procpipe/_consumer/prefetch.py: the two nodes (``Mapped``, ``Prefetcher``), which need no torch.

Both nodes pass the epoch iterator's state through (``Prefetcher`` keeps it with each batch
its thread takes ahead and reports that of the batch it returned last), so
``Loader.state_dict()`` never counts the batches the stage holds as returned.

``import procpipe`` never imports this module. ``device_stage`` is the factory of the device-stage
registry's ``"torch"`` stage (``procpipe._ext.register_device_stage``): this module registers it when
imported, and pyproject.toml declares it as the entry point ``torch`` of the group
``procpipe.device_stages``, which the first ``Loader(device=...)`` loads.

``procpipe.torch.DataLoader`` uses the same thread (``Stage``, this
module's name for ``Prefetcher``) for its ``device=``, ``pin_memory=True`` and ``timeout``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._ext import Node, Prefetcher, register_device_stage
from .convert import cpu_stage, to_torch
from .cuda_transfer import CudaTransfer

__all__ = ["CudaTransfer", "Stage", "TorchDeviceStage", "device_stage", "resolve_device", "to_torch"]

Stage = Prefetcher  # the name procpipe.torch (the DataLoader facade) uses for the prefetching thread


def resolve_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` procpipe's stage supports (``"cpu"``, ``"cuda[:N]"``, with
    the index filled in); a clear error for anything else, or CUDA where there is none."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device: {exc}") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device={device!r}: procpipe's device stage supports 'cpu' and 'cuda[:N]'")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise RuntimeError(
            f"device={device!r} needs CUDA, but torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"{build}). Use device='cpu' (tensors sharing the ring's memory) or device=None (numpy), "
            "or run where a GPU and a CUDA build of torch are available."
        )
    if resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    if resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return resolved


class TorchDeviceStage:
    """``Loader(device=...)``'s stage, made once per loader: ``stage(epoch_iterator)`` wraps
    one iteration; ``close()`` (``Loader.close``) releases the CUDA registrations."""

    def __init__(self, device: torch.device, prefetch: int, device_fn: Callable[[Any], Any] | None, seed: int) -> None:
        self.device = device
        self.prefetch = prefetch
        self.device_fn = device_fn
        self.seed = seed
        self.transfer = CudaTransfer(device, prefetch + 2, device_fn, seed) if device.type == "cuda" else None
        # Ring slots the stage may hold while its copies read them (the ring gets that many more).
        self.slots_held = CudaTransfer.SLOTS_HELD if self.transfer is not None else 0

    def __call__(self, it: Node) -> Node:
        transfer = self.transfer
        if transfer is None:
            return cpu_stage(it, self.device_fn, self.seed)
        return Prefetcher(
            it, lambda batch: transfer(batch, to_torch, getattr(it, "position", None)), depth=self.prefetch
        )

    def info(self) -> dict[str, int]:
        """``Loader.stats()["device"]``: how batches reached the device."""
        t = self.transfer
        if t is None:
            return {"direct_batches": 0, "staged_batches": 0, "registered_rings": 0, "registrations": 0}
        pins = t.pins
        return {
            "direct_batches": t.direct_batches,
            "staged_batches": t.staged_batches,
            "registered_rings": 0 if pins is None else len(pins.pinned),
            "registrations": 0 if pins is None else pins.registrations,
        }

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()


def device_stage(
    device: Any, prefetch: int, device_fn: Callable[[Any], Any] | None = None, seed: int = 0
) -> TorchDeviceStage:
    """For ``Loader(device=...)``: validate ``device`` and return ``stage(epoch_iterator)``."""
    return TorchDeviceStage(resolve_device(device), prefetch, device_fn, seed)


register_device_stage("torch", device_stage)  # Loader(device=...) finds it: procpipe/_consumer/device_stages.py
