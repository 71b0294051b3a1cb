"""The per-batch cost of a streaming source (``procpipe.Shards``) itself, by mode.

Records are tiny (one int each, nothing to compute), so what is measured is the engine:
reading blocks in the workers, the interleave, batching in the loader's process, the
shuffle buffer, and the bookkeeping that makes ``state_dict()`` exact (the record ranges
the consumer has received). For each mode it prints the steady-state time per batch
(from the 100th batch to the last but 500, median of ``--reps`` epochs) and records/s
over the whole epoch.

    python bench/streaming.py                 # about 30 s on 2 cores
    python bench/streaming.py --workers 0 --reps 5

To compare two versions of procpipe, run this file with each one first on
``PYTHONPATH`` (the workers import procpipe from there too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import procpipe

SHARDS, RECORDS, BATCH = 8, 20_000, 64


def read_ints(shard: int):
    """open_fn: RECORDS ints."""
    base = shard * 1_000_000
    for i in range(RECORDS):
        yield base + i


def epoch(workers: int, ordered: bool, shuffle_buffer: int | None) -> tuple[float, float]:
    """One epoch: (steady-state microseconds per batch, records/s over the epoch)."""
    source = procpipe.Shards(list(range(SHARDS)), read_ints, cycle_length=4)
    with procpipe.Loader(
        source, batch_size=BATCH, workers=workers, ordered=ordered, shuffle_buffer=shuffle_buffer
    ) as loader:
        batches = SHARDS * RECORDS // BATCH
        marks = {}
        start = time.perf_counter()
        for i, _ in enumerate(loader):
            if i in (100, batches - 500):
                marks[i] = time.perf_counter()
        elapsed = time.perf_counter() - start
    steady = (marks[batches - 500] - marks[100]) / (batches - 600) * 1e6
    return steady, SHARDS * RECORDS / elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    opts = p.parse_args(argv)
    print(
        f"procpipe {procpipe.__version__} ({procpipe.__file__}); {SHARDS} shards x {RECORDS:,} int records, "
        f"batch {BATCH}, cycle_length 4, workers={opts.workers}, median of {opts.reps}"
    )
    print(f"{'mode':34s} {'us/batch (steady)':>18s} {'records/s':>12s}")
    for ordered in (True, False):
        for shuffle_buffer in (None, 1000):
            runs = [epoch(opts.workers, ordered, shuffle_buffer) for _ in range(opts.reps)]
            mode = f"ordered={ordered}, shuffle_buffer={shuffle_buffer}"
            print(
                f"{mode:34s} {statistics.median(r[0] for r in runs):18.0f} "
                f"{statistics.median(r[1] for r in runs):12,.0f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
