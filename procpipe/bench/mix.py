"""``python -m procpipe.bench.mix``: what a ``procpipe.Mix`` costs per batch against a plain source.

The same elements (``--sources`` arrays, ``--length`` elements in all) read through a
``Loader`` as one concatenated array (plain) and as a ``Mix`` of the arrays (equal
weights, ``stop_on_empty=False``), ``shuffle=True``, ``seed_globals=False`` (so that the
per-sample seeding, the same in both, does not hide the difference); timed alternately
``--repeat`` times and the best of each kept. Also: the time to draw one epoch's mixed
order (the consumer's one-off cost at each epoch start).
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def _per_batch(loader) -> float:
    started = time.perf_counter()
    n = sum(1 for _ in loader)
    return (time.perf_counter() - started) / n


def measure(length: int = 200_000, sources: int = 100, batch_size: int = 64, workers: int = 0,
            repeat: int = 3) -> dict[str, float]:
    from procpipe import Loader, Mix

    parts = np.array_split(np.arange(length, dtype=np.int64), sources)
    plain_source = np.concatenate(parts)
    mix = Mix(parts, [1.0] * sources)
    best_plain = best_mix = float("inf")
    for _ in range(repeat):
        with Loader(plain_source, batch_size=batch_size, workers=workers, shuffle=True, seed=0,
                    seed_globals=False) as plain:
            best_plain = min(best_plain, _per_batch(plain))
        with Loader(mix, batch_size=batch_size, workers=workers, shuffle=True, seed=0, seed_globals=False) as mixed:
            best_mix = min(best_mix, _per_batch(mixed))
    started = time.perf_counter()
    mix.epoch_order(1, 0, True)
    order_s = time.perf_counter() - started
    return {"plain_us": best_plain * 1e6, "mix_us": best_mix * 1e6, "overhead_us": (best_mix - best_plain) * 1e6,
            "epoch_order_ms": order_s * 1e3}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m procpipe.bench.mix", description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=200_000)
    parser.add_argument("--sources", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    r = measure(args.length, args.sources, args.batch_size, args.workers, args.repeat)
    print(f"plain {r['plain_us']:.1f} us/batch, Mix {r['mix_us']:.1f} us/batch, overhead {r['overhead_us']:+.1f} "
          f"us/batch; one epoch's mixed order ({args.length} elements, {args.sources} sources): "
          f"{r['epoch_order_ms']:.1f} ms")


if __name__ == "__main__":
    main()
