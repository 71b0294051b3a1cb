"""procpipe beside Grain, feeding JAX: the same Python preprocessing, the same number of worker processes.

Each reference workload of ``procpipe/bench/workloads.py`` (``cpu``: ~2 ms of pure Python per
sample; ``transfer``: a 224x224x3 uint8 image per sample, no compute; ``tiny``: the index, batch
1 and 64: the loader's own cost per batch), two ways:

- ``host``: numpy batches. procpipe: ``Loader(dataset, batch_size=B, workers=W)``; Grain:
  ``grain.MapDataset.source(dataset).batch(B).to_iter_dataset().mp_prefetch(
  grain.MultiprocessingOptions(num_workers=W))`` (its dataset API: worker processes, shared
  memory; faster than ``grain.python.DataLoader`` on this machine's cpu and tiny workloads).
- ``device``: ``jax.Array``s on the device (a CPU device here; ``jax.devices()[0]`` wherever
  this runs), the next batches copied ahead. procpipe: ``procpipe.jax.iterator(loader,
  prefetch=2)``; Grain: ``grain.experimental.device_put(that dataset, sharding,
  cpu_buffer_size=4, device_buffer_size=2)``, the same ``NamedSharding`` (every device on
  ``"data"``). The loop waits for each batch's arrays (``jax.block_until_ready``).

The dataset object (its ``__getitem__`` is the preprocessing) is the same for both. Every
repetition runs each engine for one epoch, the engines alternating (the order rotating), and
throughput is timed after the first batch and a warm-up (``--warmup`` batches), so that start-up
(Grain starts its worker processes for each epoch's iterator; procpipe's persist) is left out of
both. Medians over ``--reps``. The goals (issue 35): procpipe at least at parity on ``cpu`` and
>= 1.5x on ``transfer`` and ``tiny``.

    python bench/jax_grain.py                         # cpu, transfer, tiny; 2 workers; 3 repetitions
    python bench/jax_grain.py --workloads transfer --reps 5 --json out.json

Needs jax and grain (``pip install procpipe[jax] grain``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from procpipe import Loader
from procpipe.bench.workloads import WORKLOADS, resolve

# Samples per workload (an epoch).
SIZES = {"cpu": 480, "transfer": 64 * 60, "tiny1": 2000, "tiny64": 64 * 1000}
GOALS = {"cpu": 1.0, "transfer": 1.5, "tiny1": 1.5, "tiny64": 1.5}
PREFETCH = 2


def grain_dataset(dataset: Any, batch_size: int, workers: int) -> Any:
    import grain

    ds = grain.MapDataset.source(dataset).batch(batch_size).to_iter_dataset()
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))


def timed(batches: Iterator[Any], warmup: int, size: Callable[[Any], float], wait: Callable[[Any], Any]) -> float:
    """Units per second over the batches after the first and ``warmup`` more."""
    start = None
    units = 0.0
    for k, batch in enumerate(batches):
        wait(batch)
        if k == warmup:
            start = time.perf_counter()
        elif k > warmup:
            units += size(batch)
    if start is None:
        raise SystemExit(f"an epoch has no more than {warmup} batches: lower --warmup or raise the sizes")
    return units / (time.perf_counter() - start)


def run_workload(name: str, workers: int, reps: int, warmup: int) -> list[dict[str, Any]]:
    import grain
    import jax

    import procpipe.jax

    workload = WORKLOADS[name]
    dataset = workload.dataset(SIZES[name])
    bs = workload.batch_size

    def first(batch: Any) -> Any:
        return batch[0] if isinstance(batch, tuple) else batch

    if workload.unit == "GB/s":

        def size(batch: Any) -> float:
            return float(first(batch).nbytes) / 1e9
    elif workload.unit == "batches/s":

        def size(batch: Any) -> float:
            return 1.0
    else:

        def size(batch: Any) -> float:
            return float(first(batch).shape[0])

    sharding = procpipe.jax.default_sharding()
    rows = []
    with Loader(dataset, batch_size=bs, workers=workers, prefetch=PREFETCH) as loader:
        device_batches = procpipe.jax.iterator(loader, sharding, prefetch=PREFETCH)
        engines: dict[tuple[str, str], Callable[[], float]] = {
            ("host", "procpipe"): lambda: timed(iter(loader), warmup, size, lambda b: b),
            ("host", "grain"): lambda: timed(iter(grain_dataset(dataset, bs, workers)), warmup, size, lambda b: b),
            ("device", "procpipe"): lambda: timed(iter(device_batches), warmup, size, jax.block_until_ready),
            ("device", "grain"): lambda: timed(
                iter(
                    grain.experimental.device_put(
                        grain_dataset(dataset, bs, workers), sharding, cpu_buffer_size=4, device_buffer_size=2
                    )
                ),
                warmup,
                size,
                jax.block_until_ready,
            ),
        }
        results: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
        keys = list(engines)
        for rep in range(reps):
            for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:  # the order rotates
                results[key].append(engines[key]())
                print(f"  {name} rep {rep} {key[0]:6} {key[1]:8} {results[key][-1]:.3f} {workload.unit}", flush=True)
    for target in ("host", "device"):
        ours = statistics.median(results[(target, "procpipe")])
        theirs = statistics.median(results[(target, "grain")])
        ratio = ours / theirs
        rows.append(
            {
                "workload": name,
                "target": target,
                "unit": workload.unit,
                "procpipe": ours,
                "grain": theirs,
                "ratio": ratio,
                "goal": GOALS[name],
                "met": ratio >= GOALS[name],
                "procpipe_runs": results[(target, "procpipe")],
                "grain_runs": results[(target, "grain")],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="cpu,transfer,tiny", help="cpu, transfer, tiny (tiny1 and tiny64)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=6, help="batches after the first left out of the timing")
    parser.add_argument("--json", help="write the rows there")
    args = parser.parse_args(argv)
    from absl import flags  # Grain reads absl flags: parsed (none given) before it runs

    flags.FLAGS(sys.argv[:1])
    import grain
    import jax

    names = resolve(args.workloads)
    print(
        f"jax {jax.__version__} ({jax.devices()[0].platform}, {jax.device_count()} device(s)), "
        f"grain {getattr(grain, '__version__', '?')}, {args.workers} workers, {args.reps} repetitions, "
        f"python {platform.python_version()}",
        flush=True,
    )
    rows = [row for name in names for row in run_workload(name, args.workers, args.reps, args.warmup)]
    print()
    print("| workload | to | procpipe | Grain | procpipe / Grain | goal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        goal = f"≥ {r['goal']:g}× {'met' if r['met'] else 'NOT met'}"
        print(
            f"| {r['workload']} ({r['unit']}) | {r['target']} | {r['procpipe']:.3f} | {r['grain']:.3f} | "
            f"{r['ratio']:.2f}× | {goal} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
