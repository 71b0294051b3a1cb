"""What a ``procpipe.Mix`` costs over a plain source holding the same elements.

Two figures, each an A/B alternation in one run (on a noisy machine only ratios measured
side by side mean anything):

- **per batch**: the steady-state seconds per batch (from the 50th batch to the end of the
  epoch) of ``Loader(plain, batch_size=64, workers=2, shuffle=True)`` and of the same loader
  over ``Mix(sources, weights)`` holding the same elements, alternating plain / mix, mix /
  plain, ... over ``--reps`` repetitions, a fresh loader each time. The mixture adds one
  ``bisect`` per element in the workers and nothing in the coordinator.
- **streams**: the same per-batch figure for ``Shards`` of tiny int records: one ``Shards`` of
  every shard against ``Mix`` of one ``Shards`` per source holding those shards (a mixture of
  streams mixes shards: the only difference is the order shards are opened in, and one call
  per shard opened).
- **indexed beside streams**: the same per-batch figure for ``Mix([array, Shards])``, the
  array (half the elements) read as slices of its epoch permutation (``shard_size``: the
  streams' shard), against the one ``Shards`` of the streams' figure holding all of them:
  what reading an indexed dataset as slices costs over streaming the same elements.
- **epoch planning**: the seconds to compute one epoch's order in the calling process (what
  ``iter(loader)`` does before the first batch is dispatched): ``IndexOrder.batches`` of a
  plain shuffled source against ``MixOrder.batches``, for ``--sources`` sources and the
  same total of elements.

    PYTHONPATH=. python bench/mix.py                      # defaults: 8 sources, 192 000 elements
    PYTHONPATH=. python bench/mix.py --sources 300 --reps 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import procpipe
from procpipe._sources.indexed.index_order import IndexOrder
from procpipe._sources.mix.mixture import MixOrder

WARMUP_BATCHES = 50


def per_batch(source: object) -> float:
    """Steady-state seconds per batch of one epoch over ``source``."""
    with procpipe.Loader(source, batch_size=64, workers=2, shuffle=True, seed=1, seed_globals=False) as loader:
        start = None
        count = 0
        for i, _ in enumerate(loader):
            if i == WARMUP_BATCHES:
                start = time.perf_counter()
            count = i
        return (time.perf_counter() - start) / (count - WARMUP_BATCHES)


def read_ints(shard: tuple[int, int]) -> range:
    return range(shard[0], shard[0] + shard[1])


def stream_sources(sources: int, elements: int) -> tuple[object, object]:
    """``(one Shards, Mix of one Shards per source)`` over the same 8 shards per source."""
    per_shard = elements // (sources * 8)
    groups = [[(k * elements + i * per_shard, per_shard) for i in range(8)] for k in range(sources)]
    plain = procpipe.Shards([s for group in groups for s in group], read_ints, cycle_length=4)
    mix = procpipe.Mix(
        [procpipe.Shards(group, read_ints, cycle_length=4) for group in groups], list(range(1, sources + 1))
    )
    return plain, mix


def kinds_sources(sources: int, elements: int) -> object:
    """``Mix([array, Shards])``: the first half of ``stream_sources``' elements as an array, the
    rest as its shards (the same shard size for both)."""
    per_shard = elements // (sources * 8)
    shards = [(k * elements + i * per_shard, per_shard) for k in range(sources) for i in range(8)]
    half = len(shards) // 2
    array = np.concatenate([np.arange(first, first + n) for first, n in shards[:half]])
    stream = procpipe.Shards(shards[half:], read_ints, cycle_length=4, lengths=[n for _, n in shards[half:]])
    return procpipe.Mix([array, stream], [1, 1])


def planning(sampler: object, reps: int) -> float:
    """Median seconds of ``sampler.batches(epoch)`` over ``reps`` epochs."""
    times = []
    for epoch in range(reps):
        t = time.perf_counter()
        sampler.batches(epoch)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", type=int, default=8)
    parser.add_argument("--elements", type=int, default=192_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    size = args.elements // args.sources
    sources = [np.arange(k * size, (k + 1) * size) for k in range(args.sources)]
    weights = list(range(1, args.sources + 1))
    plain = np.arange(size * args.sources)
    mix = procpipe.Mix(sources, weights)

    runs: dict[str, list[float]] = {"plain": [], "mix": []}
    for rep in range(args.reps):
        order = ("plain", "mix") if rep % 2 == 0 else ("mix", "plain")
        for name in order:
            runs[name].append(per_batch(plain if name == "plain" else mix))
    a, b = statistics.median(runs["plain"]), statistics.median(runs["mix"])
    print(f"per batch (batch_size=64, workers=2, {args.sources} sources, {len(plain)} elements, {args.reps} reps)")
    print(
        f"  plain {a * 1e6:8.1f} us   mix {b * 1e6:8.1f} us   mix/plain {b / a:.3f}   "
        f"(spread plain {min(runs['plain']) * 1e6:.1f}-{max(runs['plain']) * 1e6:.1f}, "
        f"mix {min(runs['mix']) * 1e6:.1f}-{max(runs['mix']) * 1e6:.1f})"
    )

    plain_stream, mix_stream = stream_sources(args.sources, len(plain))
    runs = {"plain": [], "mix": []}
    for rep in range(args.reps):
        order = ("plain", "mix") if rep % 2 == 0 else ("mix", "plain")
        for name in order:
            runs[name].append(per_batch(plain_stream if name == "plain" else mix_stream))
    a, b = statistics.median(runs["plain"]), statistics.median(runs["mix"])
    print(f"streams, per batch ({args.sources} sources of 8 shards)")
    print(
        f"  plain {a * 1e6:8.1f} us   mix {b * 1e6:8.1f} us   mix/plain {b / a:.3f}   "
        f"(spread plain {min(runs['plain']) * 1e6:.1f}-{max(runs['plain']) * 1e6:.1f}, "
        f"mix {min(runs['mix']) * 1e6:.1f}-{max(runs['mix']) * 1e6:.1f})"
    )

    mix_kinds = kinds_sources(args.sources, len(plain))
    runs = {"plain": [], "mix": []}
    for rep in range(args.reps):
        order = ("plain", "mix") if rep % 2 == 0 else ("mix", "plain")
        for name in order:
            runs[name].append(per_batch(plain_stream if name == "plain" else mix_kinds))
    a, b = statistics.median(runs["plain"]), statistics.median(runs["mix"])
    print("indexed beside streams, per batch (half the elements an array read as slices, against one Shards)")
    print(
        f"  plain {a * 1e6:8.1f} us   mix {b * 1e6:8.1f} us   mix/plain {b / a:.3f}   "
        f"(spread plain {min(runs['plain']) * 1e6:.1f}-{max(runs['plain']) * 1e6:.1f}, "
        f"mix {min(runs['mix']) * 1e6:.1f}-{max(runs['mix']) * 1e6:.1f})"
    )

    plans: dict[str, list[float]] = {"plain": [], "mix": []}
    plain_sampler = IndexOrder(len(plain), 64, True, 1, False)
    mix_sampler = MixOrder(len(mix), 64, True, 1, False, mix=mix)
    for rep in range(args.reps):
        order = ("plain", "mix") if rep % 2 == 0 else ("mix", "plain")
        for name in order:
            plans[name].append(planning(plain_sampler if name == "plain" else mix_sampler, 3))
    a, b = statistics.median(plans["plain"]), statistics.median(plans["mix"])
    print(
        f"epoch planning ({len(plain)} elements): plain {a * 1e3:.1f} ms   mix {b * 1e3:.1f} ms   mix/plain {b / a:.2f}"
    )


if __name__ == "__main__":
    main()
