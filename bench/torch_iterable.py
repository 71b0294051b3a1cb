"""An ``IterableDataset`` through torch's DataLoader and through ``procpipe.torch.DataLoader``.

Each worker yields its share of the samples (sharding by ``get_worker_info()``), batched
by ``default_collate`` in the worker. Two workloads: ``tiny`` (one int per sample: the
cost of the loader itself per batch) and ``images`` (a 3x64x64 float32 tensor per sample:
moving batches between processes). Both loaders keep their workers (``persistent_workers``)
and run one warm-up epoch; then the two are timed alternately, epoch by epoch, and the
median of ``--reps`` epochs is printed with the ratio (only that ratio, taken side by side
in one run, means anything on a busy machine).

    python bench/torch_iterable.py              # about a minute on 2 cores
    python bench/torch_iterable.py --workers 4 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.utils.data as tud

from procpipe.torch import DataLoader

WORKLOADS = {"tiny": (64_000, ()), "images": (8_000, (3, 64, 64))}  # samples, shape of each (() = an int)


class Sharded(tud.IterableDataset):
    def __init__(self, n: int, shape: tuple[int, ...]) -> None:
        self.n, self.shape = n, shape

    def __iter__(self):
        info = tud.get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(w, self.n, k):
            yield torch.full(self.shape, float(i)) if self.shape else i


def seconds(loader) -> tuple[float, int]:
    started = time.perf_counter()
    batches = sum(1 for _ in loader)
    return time.perf_counter() - started, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    print(f"workers={args.workers} batch_size={args.batch_size} reps={args.reps} (median epoch)")
    print(f"{'workload':<8} {'torch batches/s':>16} {'procpipe batches/s':>19} {'procpipe/torch':>15}")
    for name, (n, shape) in WORKLOADS.items():
        loaders = {
            cls: cls(
                Sharded(n, shape),
                batch_size=args.batch_size,
                num_workers=args.workers,
                persistent_workers=True,
                multiprocessing_context="fork",
            )
            for cls in (tud.DataLoader, DataLoader)
        }
        times: dict[type, list[float]] = {cls: [] for cls in loaders}
        counts = {cls: seconds(loader)[1] for cls, loader in loaders.items()}  # warm-up: workers start
        assert len(set(counts.values())) == 1, f"the loaders gave different batch counts: {counts}"
        for _ in range(args.reps):
            for cls, loader in loaders.items():
                times[cls].append(seconds(loader)[0])
        rate = {cls: counts[cls] / statistics.median(t) for cls, t in times.items()}
        print(
            f"{name:<8} {rate[tud.DataLoader]:>16.0f} {rate[DataLoader]:>19.0f} "
            f"{rate[DataLoader] / rate[tud.DataLoader]:>15.2f}"
        )
        loaders[DataLoader].close()


if __name__ == "__main__":
    main()
