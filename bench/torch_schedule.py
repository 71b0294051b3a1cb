"""The torch facade's schedule: torch's rotation (the default) against procpipe's balanced
dispatch (``assign="balanced"``), beside torch's own DataLoader, on a map-style dataset.

The facade's default follows torch (batch k to worker ``k % num_workers``, torch's seeds)
so that a drop-in yields torch's very batches; ``assign="balanced"`` gives each batch to
the least busy worker instead. This prints what the choice costs:

- ``tiny``: one int per sample, batch 64 (the loader's own cost per batch);
- ``cpu``: ~1 ms of GIL-bound Python per sample, batch 16 (even work);
- ``uneven``: the same, but every 7th batch costs 6x (stragglers): the rotation waits for
  a slow worker's batches, balanced dispatch goes around them.

All loaders keep their workers (``persistent_workers``, ``fork``) and run one warm-up
epoch; then they are timed alternately, epoch by epoch (the order rotates), and the median
of ``--reps`` epochs is printed with ratios taken in this one run.

    python bench/torch_schedule.py             # about two minutes on 2 cores
    python bench/torch_schedule.py --workers 4 --reps 7
"""

from __future__ import annotations

import argparse
import statistics

import torch.utils.data as tud
from torch_iterable import seconds  # (bench/ is this script's directory: sys.path[0])

from procpipe.torch import DataLoader


def _spin(units: int) -> int:
    acc = 0
    for k in range(units * 7000):  # ~1 ms of Python per unit on a 2020s core
        acc = (acc * 31 + k) % 1000003
    return acc


class Work(tud.Dataset):
    def __init__(self, n: int, units: int, slow_every: int, batch_size: int) -> None:
        self.n, self.units, self.slow_every, self.batch_size = n, units, slow_every, batch_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.units:
            slow = self.slow_every and (i // self.batch_size) % self.slow_every == 0
            _spin(self.units * (6 if slow else 1))
        return i


WORKLOADS = {  # name: (samples, units of work per sample, every n-th batch slow, batch size)
    "tiny": (64 * 600, 0, 0, 64),
    "cpu": (16 * 60, 1, 0, 16),
    "uneven": (16 * 60, 1, 7, 16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    print(f"workers={args.workers} reps={args.reps} (median epoch, batches/s; ratios from this run)")
    print(
        f"{'workload':<8} {'torch':>9} {'rotation':>9} {'balanced':>9} {'rotation/torch':>15} {'balanced/rotation':>18}"
    )
    for name in args.workloads.split(","):
        n, units, slow_every, batch_size = WORKLOADS[name]
        dataset = Work(n, units, slow_every, batch_size)
        common = {
            "batch_size": batch_size,
            "num_workers": args.workers,
            "persistent_workers": True,
            "multiprocessing_context": "fork",
        }
        loaders = {
            "torch": tud.DataLoader(dataset, **common),
            "rotation": DataLoader(dataset, **common),
            "balanced": DataLoader(dataset, assign="balanced", **common),
        }
        counts = {key: seconds(loader)[1] for key, loader in loaders.items()}  # warm-up: workers start
        assert len(set(counts.values())) == 1, f"the loaders gave different batch counts: {counts}"
        times: dict[str, list[float]] = {key: [] for key in loaders}
        keys = list(loaders)
        for rep in range(args.reps):
            for key in keys[rep % 3 :] + keys[: rep % 3]:
                times[key].append(seconds(loaders[key])[0])
        rate = {key: counts[key] / statistics.median(t) for key, t in times.items()}
        print(
            f"{name:<8} {rate['torch']:>9.1f} {rate['rotation']:>9.1f} {rate['balanced']:>9.1f} "
            f"{rate['rotation'] / rate['torch']:>14.2f}x {rate['balanced'] / rate['rotation']:>17.2f}x"
        )
        for key, loader in loaders.items():
            if key != "torch":
                loader.close()


if __name__ == "__main__":
    main()
