"""The reference workloads, shared by ``python -m procpipe.bench`` and ``bench/compare.py``.

They are the workloads the performance goals are measured on (docs/benchmarks.md#performance-goals).

Every dataset is a module-level class (picklable by reference, so any start method and
any loader can ship it to its workers) with ``__len__`` and ``__getitem__(int)``:

========== ============================================================ ======
name       per sample                                                   batch
========== ============================================================ ======
cpu        a pure-Python loop holding the GIL (about 2 ms); returns a   20
           256-float32 vector and an int label
transfer   a copy of a preloaded 224x224x3 uint8 image                  64
straggler  ``time.sleep(1 ms)``, every 10th sample 20 ms (I/O stall)     10
tiny1      its index, nothing else (the engine's per-batch overhead)    1
tiny64     the same, batched by 64                                      64
========== ============================================================ ======

``WORKLOADS`` maps each name to a :class:`Workload` (the dataset factory, batch size,
sizes for quick and full runs, and the unit its throughput is reported in).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

CPU_ITERS = 40_000  # iterations of the cpu workload's loop: about 2 ms on the reference machine
IMAGE_SHAPE = (224, 224, 3)


def _burn(iters: int, seed: int) -> int:
    x = seed
    for i in range(iters):
        x = (x * 31 + i) & 0xFFFFFF
    return x


class CpuDataset:
    """``cpu``: pure Python holding the GIL for about 2 ms, then a small numpy sample."""

    def __init__(self, n: int, iters: int = CPU_ITERS) -> None:
        self.n = n
        self.iters = iters

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        x = _burn(self.iters, i)
        return np.full(256, x & 0xFF, dtype=np.float32), i % 10


class TransferDataset:
    """``transfer``: a copy of one preloaded 224x224x3 uint8 image per sample; almost no compute."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.image = np.random.default_rng(0).integers(0, 256, IMAGE_SHAPE, dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.image.copy()


class StragglerDataset:
    """``straggler``: sleeps 1 ms per sample, but 20 ms on every 10th (``i % 10 == 0``)."""

    def __init__(self, n: int, fast_s: float = 0.001, slow_s: float = 0.020, every: int = 10) -> None:
        self.n = n
        self.fast_s = fast_s
        self.slow_s = slow_s
        self.every = every

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        time.sleep(self.slow_s if i % self.every == 0 else self.fast_s)
        return i

    @property
    def mean_sample_s(self) -> float:
        """Nominal seconds per sample (sleep overshoot not included)."""
        return (self.slow_s + (self.every - 1) * self.fast_s) / self.every


class TinyDataset:
    """``tiny``: returns its index; measures the loader's own cost per batch."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return i


@dataclass(frozen=True)
class Workload:
    """A reference workload: how to build it and how to report it."""

    name: str
    make: Callable[[int], Any]  # number of samples -> dataset
    batch_size: int
    quick_size: int  # samples in a quick run (the bench's default)
    full_size: int  # samples in a full run (bench/compare.py without --quick)
    unit: str  # "samples/s", "batches/s" or "GB/s": what its throughput is reported in
    description: str
    sample_bytes: int = 0  # array bytes per sample

    def dataset(self, size: int | None = None, quick: bool = True) -> Any:
        return self.make(size if size is not None else (self.quick_size if quick else self.full_size))


WORKLOADS: dict[str, Workload] = {
    "cpu": Workload(
        "cpu",
        CpuDataset,
        20,
        1000,
        2000,
        "samples/s",
        "pure-Python loop holding the GIL (~2 ms/sample), 256 float32 + label",
        256 * 4 + 8,
    ),
    "transfer": Workload(
        "transfer",
        TransferDataset,
        64,
        64 * 120,
        64 * 200,
        "GB/s",
        "copy of a preloaded 224x224x3 uint8 image, batch 64 = 9.6 MB",
        int(np.prod(IMAGE_SHAPE)),
    ),
    "straggler": Workload(
        "straggler",
        StragglerDataset,
        10,
        600,
        1200,
        "samples/s",
        "sleep 1 ms, every 10th sample 20 ms (I/O-like stall)",
        8,
    ),
    "tiny1": Workload(
        "tiny1", TinyDataset, 1, 10000, 20000, "batches/s", "returns its index; batch 1 (engine overhead per batch)", 8
    ),
    "tiny64": Workload(
        "tiny64",
        TinyDataset,
        64,
        64 * 5000,
        64 * 10000,
        "batches/s",
        "returns its index; batch 64 (engine overhead per batch)",
        8,
    ),
}
ALIASES = {"tiny": ("tiny1", "tiny64")}


def resolve(names: str | None) -> list[str]:
    """``"cpu,tiny"`` -> ``["cpu", "tiny1", "tiny64"]``; None -> every workload."""
    if not names:
        return list(WORKLOADS)
    out: list[str] = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        expanded = ALIASES.get(name, (name,))
        for n in expanded:
            if n not in WORKLOADS:
                raise ValueError(f"unknown workload {name!r}; choose from {', '.join([*WORKLOADS, *ALIASES])}")
            if n not in out:
                out.append(n)
    return out


def simple_collate(samples: list) -> Any:
    """Stack samples the plain-numpy way (used by the serial and Pool baselines)."""
    first = samples[0]
    if isinstance(first, np.ndarray):
        return np.stack(samples)
    if isinstance(first, Mapping):
        return {k: simple_collate([s[k] for s in samples]) for k in first}
    if isinstance(first, (tuple, list)):
        columns = [simple_collate(list(col)) for col in zip(*samples, strict=False)]
        return columns if isinstance(first, list) else tuple(columns)
    return np.asarray(samples)


def load_batch(source: Any, indices: list[int]) -> Any:
    """One batch, serially: ``simple_collate([source[i] for i in indices])``."""
    return simple_collate([source[i] for i in indices])
