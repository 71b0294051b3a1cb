"""Pipeline stages: what ``batch_fn`` and ``cache`` buy, side by side, in one run.

(a) ``batch_fn``. A cheap per-sample function, normalizing a 32-float32 vector
    (``(x - mean) / (std + eps)``), done per sample in ``fn`` versus vectorized over the
    batch in ``batch_fn``, batch 256. Samples/s over whole epochs (after one warm-up
    epoch: workers started, ring sized), best of ``--reps``, with 2 workers and 0 workers.

(b) ``cache``. An expensive deterministic decode (about ``--decode-ms`` ms of pure Python
    per sample, a 256-float32 vector) plus a cheap random augmentation (a flip and noise
    from ``sample_rng()``), batch 32: the time of epochs 1, 2 and 3 without a cache, with
    ``cache=True`` (shared memory) and with ``cache=<directory>`` (a memory-mapped file in
    a temporary directory on disk), for 2 workers and 0 workers. The creation of a
    cached loader includes the first sample, computed in the calling process; it is
    reported apart. Outputs with and without cache are checked identical.

    python bench/stages.py                 # default sizes (about 60 s on 2 cores)
    python bench/stages.py --quick         # smaller (about 15 s)
    python bench/stages.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from procpipe import Loader, sample_rng

EPS = 1e-6


# ----------------------------------------------------------------------------- (a)
def normalize_one(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / (x.std() + EPS)


def normalize_batch(batch: np.ndarray) -> np.ndarray:
    return (batch - batch.mean(axis=1, keepdims=True)) / (batch.std(axis=1, keepdims=True) + EPS)


def samples_per_s(loader: Loader, reps: int) -> float:
    for _ in loader:  # warm-up epoch: workers started, ring sized
        pass
    best = 0.0
    for _ in range(reps):
        started, n = time.perf_counter(), 0
        for batch in loader:
            n += len(batch)
        best = max(best, n / (time.perf_counter() - started))
    return best


def bench_batch_fn(samples: int, workers_list: list[int], reps: int) -> list[dict[str, Any]]:
    data = np.random.default_rng(0).random((samples, 32), dtype=np.float32)
    rows = []
    for workers in workers_list:
        row: dict[str, Any] = {"workers": workers}
        for name, kwargs in (("per_sample_fn", {"fn": normalize_one}), ("batch_fn", {"batch_fn": normalize_batch})):
            with Loader(data, batch_size=256, workers=workers, **kwargs) as loader:
                row[name] = samples_per_s(loader, reps)
        with (
            Loader(data, normalize_one, batch_size=256, workers=0) as a,
            Loader(data, batch_size=256, workers=0, batch_fn=normalize_batch) as b,
        ):
            np.testing.assert_allclose(next(iter(a)), next(iter(b)), rtol=1e-5, atol=1e-5)
        row["gain"] = row["batch_fn"] / row["per_sample_fn"]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- (b)
class Decode:
    """``fn``: about ``ms`` ms of pure Python per sample (an LCG loop), then a 256-float32 vector."""

    def __init__(self, loops: int) -> None:
        self.loops = loops

    def __call__(self, i: int) -> dict[str, Any]:
        acc = i + 1
        for _ in range(self.loops):
            acc = (acc * 1103515245 + 12345) & 0x7FFFFFFF
        vector = np.sin(np.arange(256, dtype=np.float32) * np.float32(acc % 1000 / 1000.0))
        return {"x": vector, "label": i % 10}


def augment(sample: dict[str, Any]) -> dict[str, Any]:
    rng = sample_rng()
    x = sample["x"]
    if rng.random() < 0.5:
        x = x[::-1]
    sample["x"] = x + rng.normal(0, 0.01, x.shape).astype(np.float32)
    return sample


def calibrate(ms: float) -> tuple[int, float]:
    """Loop count for about ``ms`` ms per sample, and the measured time per sample."""
    probe = Decode(20_000)
    started = time.perf_counter()
    for i in range(20):
        probe(i)
    per_loop = (time.perf_counter() - started) / 20 / 20_000
    loops = max(1, int(ms / 1000 / per_loop))
    decode = Decode(loops)
    started = time.perf_counter()
    for i in range(20):
        decode(i)
    return loops, (time.perf_counter() - started) / 20 * 1000


def timed_epochs(loader: Loader, epochs: int) -> tuple[list[float], list[np.ndarray]]:
    times, first_epoch = [], []
    for e in range(epochs):
        started = time.perf_counter()
        for batch in loader:
            if e == 0:  # every epoch is timed; only the first one's batches are kept
                first_epoch.append(np.array(batch["x"]))  # noqa: PERF401
        times.append(time.perf_counter() - started)
    return times, first_epoch


def bench_cache(samples: int, loops: int, workers_list: list[int], epochs: int) -> list[dict[str, Any]]:
    rows = []
    disk = tempfile.mkdtemp(
        prefix="procpipe-bench-cache-",
        dir=os.path.expanduser("~") if os.access(os.path.expanduser("~"), os.W_OK) else None,
    )
    try:
        for workers in workers_list:
            reference = None
            for name, cache in (("no cache", None), ("cache=True (memory)", True), ("cache=<dir> (disk)", disk)):
                started = time.perf_counter()
                with Loader(
                    list(range(samples)),
                    Decode(loops),
                    batch_size=32,
                    workers=workers,
                    shuffle=True,
                    augment=augment,
                    cache=cache,
                ) as loader:
                    created = time.perf_counter() - started
                    times, first = timed_epochs(loader, epochs)
                    info = loader.cache_info()
                if reference is None:
                    reference = first
                same = len(first) == len(reference) and all(
                    np.array_equal(a, b) for a, b in zip(reference, first, strict=True)
                )
                rows.append(
                    {
                        "workers": workers,
                        "cache": name,
                        "create_s": created,
                        "epoch_s": times,
                        "identical_to_no_cache": same,
                        "cache_mib": None if info is None else info["bytes"] / 2**20,
                    }
                )
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return rows


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (about 15 s)")
    parser.add_argument("--samples-a", type=int, help="samples for (a) (default 60000; quick 30000)")
    parser.add_argument("--samples-b", type=int, help="samples for (b) (default 2000; quick 600)")
    parser.add_argument("--decode-ms", type=float, default=2.0, help="decode time per sample in (b)")
    parser.add_argument("--reps", type=int, help="timed epochs per setting in (a), best kept (default 3; quick 1)")
    parser.add_argument("--workers", default="2,0", help="worker counts (default 2,0)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    samples_a = args.samples_a or (30_000 if args.quick else 60_000)
    samples_b = args.samples_b or (600 if args.quick else 2000)
    reps = args.reps or (1 if args.quick else 3)
    workers_list = [int(w) for w in args.workers.split(",")]
    print(
        f"procpipe stage benchmark: {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}"
    )

    started = time.perf_counter()
    rows_a = bench_batch_fn(samples_a, workers_list, reps)
    print(
        f"\n(a) batch_fn: normalize a 32-float32 vector, {samples_a} samples, batch 256, "
        f"samples/s (best of {reps} epochs)"
    )
    print(f"{'workers':>7}  {'per sample in fn':>16}  {'vectorized batch_fn':>19}  {'gain':>6}")
    for r in rows_a:
        print(f"{r['workers']:>7}  {r['per_sample_fn']:>16,.0f}  {r['batch_fn']:>19,.0f}  {r['gain']:>5.1f}x")

    loops, ms = calibrate(args.decode_ms)
    rows_b = bench_cache(samples_b, loops, workers_list, 3)
    print(
        f"\n(b) cache: decode {ms:.2f} ms/sample of pure Python (measured) + random augment, {samples_b} samples, "
        "batch 32, shuffled; seconds per epoch"
    )
    print(
        f"{'workers':>7}  {'stage':<20}  {'create':>6}  {'epoch 1':>7}  {'epoch 2':>7}  {'epoch 3':>7}  "
        f"{'2 vs 1':>7}  {'2 vs no cache':>13}  {'same':>4}"
    )
    no_cache = {}
    for r in rows_b:
        e1, e2, e3 = r["epoch_s"]
        if r["cache"] == "no cache":
            no_cache[r["workers"]] = e2
        vs = no_cache[r["workers"]] / e2
        print(
            f"{r['workers']:>7}  {r['cache']:<20}  {r['create_s']:>6.2f}  {e1:>7.3f}  {e2:>7.3f}  {e3:>7.3f}  "
            f"{e1 / e2:>6.1f}x  {vs:>12.1f}x  {'yes' if r['identical_to_no_cache'] else 'NO':>4}"
        )
    total = time.perf_counter() - started
    print(f"\ntotal {total:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "cpu_count": os.cpu_count(),
                    "batch_fn": rows_a,
                    "cache": rows_b,
                    "decode_ms": ms,
                    "samples_a": samples_a,
                    "samples_b": samples_b,
                    "total_s": total,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
