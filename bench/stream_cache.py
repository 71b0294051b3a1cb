"""``cache=`` on a stream (``procpipe.Shards``): with and without ``lengths``, side by side.

An expensive deterministic decode (about ``--decode-ms`` ms of pure Python per record, a
256-float32 vector), ``--shards`` shards of ``--records`` records, batch 32: the time of
epochs 1, 2 and 3 without a cache, with ``cache=True`` and ``Shards(lengths=...)`` (the
file laid out up front), with ``cache=True`` without lengths (the cache that grows as
records arrive) and with ``cache=<directory>`` without lengths, for 2 workers and 0
workers. The settings run in turn, ``--reps`` times (alternated, the best kept), and the
outputs of every setting are checked identical.

    python bench/stream_cache.py           # default sizes (about 40 s on 2 cores)
    python bench/stream_cache.py --quick   # smaller
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import numpy as np

from procpipe import Loader, Shards


def open_shard(shard: tuple[int, int]):
    for i in range(shard[1]):
        yield shard[0] * 100_000 + i


class Decode:
    """About ``ms`` ms of pure Python per record (a seeded recurrence), then a 256-float32 vector."""

    def __init__(self, ms: float) -> None:
        self.steps = int(ms * 25_000 / 1.0 / 10)

    def __call__(self, record: int) -> np.ndarray:
        x = record
        for _ in range(self.steps):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        return np.full(256, x % 1000, np.float32)


def run(setting: str, workers: int, shards: list, decode: Decode, cache_dir: str) -> tuple[list[float], list]:
    lengths = [n for _, n in shards] if setting == "lengths" else None
    cache = {"none": None, "lengths": True, "growing": True, "growing-dir": cache_dir}[setting]
    source = Shards(shards, open_shard, cycle_length=4, block_length=32, lengths=lengths)
    times, sums = [], []
    with Loader(source, decode, batch_size=32, workers=workers, cache=cache) as loader:
        for _ in range(3):
            start = time.perf_counter()
            sums.append([float(b.sum()) for b in loader])
            times.append(time.perf_counter() - start)
    return times, sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--records", type=int, default=150)
    parser.add_argument("--decode-ms", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.records, args.reps = 50, 1
    shards = [(s, args.records + 7 * s) for s in range(args.shards)]  # uneven shards
    decode = Decode(args.decode_ms)
    settings = ["none", "lengths", "growing", "growing-dir"]
    print(f"{args.shards} shards, {sum(n for _, n in shards)} records, ~{args.decode_ms} ms decode, batch 32")
    print("| workers | cache | epoch 1 (s) | epoch 2 (s) | epoch 3 (s) | epoch 1 / epoch 2 | identical |")
    print("|---|---|---|---|---|---|---|")
    cache_dir = tempfile.mkdtemp(prefix="stream-cache-bench-")
    try:
        for workers in (2, 0):
            best: dict[str, list[float]] = {}
            outputs: dict[str, list] = {}
            for _ in range(args.reps):
                for setting in settings:
                    times, sums = run(setting, workers, shards, decode, cache_dir)
                    best[setting] = [min(a, b) for a, b in zip(best.get(setting, times), times, strict=True)]
                    outputs[setting] = sums
            for setting in settings:
                t = best[setting]
                same = outputs[setting] == outputs["none"]
                print(
                    f"| {workers} | {setting} | {t[0]:.3f} | {t[1]:.3f} | {t[2]:.3f} | {t[0] / t[1]:.0f}x | "
                    f"{'yes' if same else 'NO'} |"
                )
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
