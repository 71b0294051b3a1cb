"""``workers="auto"`` against fixed worker counts, on the reference workloads.

For each workload (``cpu``, ``transfer``, ``straggler``, ``tiny64`` by default, from
``procpipe/bench/workloads.py``) this runs the same endless stream (``epochs=None``) with
1, 2, 3 and 4 fixed workers and with ``workers="auto"``, one after the other in one
process, each for ``--warmup`` and then ``--seconds`` seconds after its first batch, the
consumer taking batches as fast as it can (plus ``--step-ms`` of sleep per batch if asked).
Every setting is measured alike over the window after its warm-up: that is the throughput
a training run gets once the tuner has settled (target: auto at least 0.90 of the best
fixed count). What tuning costs shows in the same ratio over the whole run, warm-up
included, and in auto's trace of worker counts (``count@seconds since the loader was
built``).

On a noisy machine the best of four fixed counts is itself a noisy maximum, biased
upwards; so each setting's spread over the repetitions (``(max - min) / median``) is
printed too: a gap between auto and the best fixed count smaller than that spread is
noise, not a verdict.

    python bench/autotune.py                          # about 5 min on 2 cores
    python bench/autotune.py --workloads straggler --seconds 10 --reps 3 --json out.json

Settings rotate between repetitions (``--reps``), so that drift on a noisy machine hits
them alike; the table shows each setting's median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import procpipe
from procpipe.bench.workloads import WORKLOADS, resolve
from procpipe.config import cpu_count

DEFAULT_WORKLOADS = "cpu,transfer,straggler,tiny64"
FIXED = (1, 2, 3, 4)
TARGET = 0.90


def run(name: str, workers: Any, warmup: float, seconds: float, step_s: float) -> dict[str, Any]:
    """One setting: samples/s after the warm-up and over the whole run, and the loader's stats."""
    w = WORKLOADS[name]
    loader = procpipe.Loader(w.dataset(quick=True), batch_size=w.batch_size, workers=workers, epochs=None, shuffle=True)
    try:
        it = iter(loader)
        t0 = time.perf_counter()
        next(it)
        first = time.perf_counter() - t0
        start = time.perf_counter()
        settled, end = start + warmup, start + warmup + seconds
        samples = samples_warm = 0
        mid = None
        for batch in it:
            n = len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch)
            samples += n
            del batch
            if step_s:
                time.sleep(step_s)
            now = time.perf_counter()
            if mid is None and now >= settled:
                mid, samples_warm = now, samples
            if now >= end:
                break
        stop = time.perf_counter()
        stats = loader.stats()
    finally:
        loader.close()
    return {
        "workers": workers if isinstance(workers, int) else "auto",
        "first_batch_s": first,
        "seconds": stop - start,
        "samples_per_s": (samples - samples_warm) / (stop - mid) if mid and stop > mid else 0.0,
        "whole_run_samples_per_s": samples / (stop - start),
        "final_workers": stats["workers"],
        "autotune": stats["autotune"],
    }


def spread_of(values: list[float]) -> float:
    """``(max - min) / median`` of one setting's repetitions: how much the machine's noise moves it."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else 0.0


def compress(trace: list) -> str:
    """``[[t, n, rate, wait], ...]`` -> ``"2@0.3s 3@0.8s 4@1.3s ..."`` (only the changes)."""
    out, last = [], None
    for t, n, _rate, _wait in trace:
        if n != last:
            out.append(f"{n}@{t:.1f}s")
            last = n
    return " ".join(out) or "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS, help=f"default {DEFAULT_WORKLOADS}")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before the window, per setting (default 2)")
    p.add_argument("--seconds", type=float, default=4.0, help="measured window per setting (default 4)")
    p.add_argument("--reps", type=int, default=2, help="repetitions, settings rotating (default 2)")
    p.add_argument("--step-ms", type=float, default=0.0, help="training step per batch, slept (default 0)")
    p.add_argument("--json", metavar="FILE", help="write every run and the summary as JSON")
    opts = p.parse_args(argv)
    names = resolve(opts.workloads)
    settings: list[Any] = [*FIXED, "auto"]
    print(
        f"procpipe {procpipe.__version__}, python {platform.python_version()}, {cpu_count()} CPUs; "
        f"{opts.warmup:g} s warm-up + {opts.seconds:g} s window per setting, {opts.reps} repetition(s), "
        f"step {opts.step_ms:g} ms"
    )
    report: dict[str, Any] = {
        "cpus": cpu_count(),
        "warmup": opts.warmup,
        "seconds": opts.seconds,
        "reps": opts.reps,
        "step_ms": opts.step_ms,
        "workloads": {},
    }
    summary = []
    for name in names:
        runs: dict[str, list[dict]] = {str(s): [] for s in settings}
        for rep in range(opts.reps):
            k = rep % len(settings)
            for s in settings[k:] + settings[:k]:
                result = run(name, s, opts.warmup, opts.seconds, opts.step_ms / 1e3)
                runs[str(s)].append(result)
                print(f"  {name:9s} workers={s!s:4s} {result['samples_per_s']:10,.0f} samples/s", flush=True)
        med = {s: statistics.median(r["samples_per_s"] for r in runs[s]) for s in runs}
        spread = {s: spread_of([r["samples_per_s"] for r in runs[s]]) for s in runs}
        best_fixed = max((str(s) for s in FIXED), key=lambda s: med[s])
        whole = {s: statistics.median(r["whole_run_samples_per_s"] for r in runs[s]) for s in (best_fixed, "auto")}
        ratio = med["auto"] / med[best_fixed]
        ratio_whole = whole["auto"] / whole[best_fixed]
        last_auto = runs["auto"][-1]
        trace = last_auto["autotune"]["trace"] if last_auto["autotune"] else []
        print(
            f"\n{name}: "
            + "  ".join(f"{s}: {med[s]:,.0f} (±{spread[s] / 2:.0%})" for s in runs)
            + " samples/s after warm-up, median (half the spread over repetitions)"
        )
        print(
            f"  auto / best fixed ({best_fixed} workers): {ratio:.2f} after warm-up (target >= {TARGET:.2f}: "
            f"{'met' if ratio >= TARGET else 'NOT met'}), {ratio_whole:.2f} over the whole run"
        )
        info = last_auto["autotune"]
        print(
            f"  auto's workers: {compress(trace)}; final {last_auto['final_workers']}, I/O-bound: {info['io_bound']}, "
            f"CPUs contended: {info['contended']}, limit {info['limit']}\n",
            flush=True,
        )
        noise = spread[best_fixed]
        summary.append((name, best_fixed, med[best_fixed], med["auto"], ratio, ratio_whole, noise, compress(trace)))
        report["workloads"][name] = {
            "runs": runs,
            "median_samples_per_s": med,
            "spread": spread,
            "best_fixed": int(best_fixed),
            "auto_over_best": ratio,
            "auto_over_best_whole_run": ratio_whole,
        }
    head = (
        "workload",
        "best fixed",
        "samples/s",
        "auto samples/s",
        "auto/best",
        "whole run",
        "best's spread",
        "auto's workers",
    )
    rows = [head] + [
        (n, b, f"{m:,.0f}", f"{a:,.0f}", f"{r:.2f}", f"{h:.2f}", f"{z:.0%}", t) for n, b, m, a, r, h, z, t in summary
    ]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    for i, r in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
