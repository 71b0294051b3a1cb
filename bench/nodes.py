"""``workers="auto"`` on a real node: one loader, and several ranks (processes) per node.

For each workload (``cpu`` and ``straggler`` by default, from ``procpipe/bench/workloads.py``)
this measures, one setting after the other on an endless stream (``epochs=None``), the
consumer taking batches as fast as it can:

1. **One loader.** Fixed worker counts (default 1, 2, 4, 8, 15, 16: scaled to the CPU
   budget, see below) for ``--fixed-seconds`` each, after a first batch and ``--warmup``;
   then ``workers="auto"`` for ``--auto-seconds`` (default 60), printing its rate and worker
   count every ``--every`` seconds (default 5). It reports auto's rate after ``--settle``
   seconds (default 15) against the best fixed count and against ``workers=2``.
2. **Several ranks.** ``--ranks`` processes (default 4), each with its own loader, as the
   ranks of one DDP job on one node: all ``"auto"``, against all fixed at ``budget / ranks``
   (the best fixed split) and all at ``budget - 1`` (``num_workers=os.cpu_count() - 1``,
   oversubscribed). The ranks start together and are measured over the same window
   (``--rank-seconds`` after ``--settle``); the sum of their rates is compared.

The CPU budget is ``procpipe._core.cpus.cpu_budget()`` (affinity and cgroup quota). On
fewer than 8 CPUs (``--quick``, or automatically) the lists scale down: fixed counts
``1, 2, 4`` (and the budget), ``min(4, budget)`` ranks, shorter runs (auto 20 s, fixed 8 s,
ranks 20 s, settle 10 s), which checks the 2-core goals in one run of about 5 minutes:
``auto`` on ``cpu`` >= 0.90 of ``workers=2`` after 10 s, on ``straggler`` >= 2x ``workers=2``.

    python bench/nodes.py                        # a 16-CPU node: about 15 minutes
    python bench/nodes.py --quick                # 2 cores: about 5 minutes
    python bench/nodes.py --quick --reps 3       # 2 cores, shared: medians of 3, settings rotating
    python bench/nodes.py --workloads cpu --json nodes.json

Goals on a 16-CPU node (issue 32): one loader's auto >= 0.95 of the best fixed count within
15 s; ``ranks x auto`` >= 0.95 of ``ranks x fixed budget/ranks``. On a shared machine say so
beside the numbers: other processes move every figure (the ratios, measured in one run,
less so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import procpipe  # noqa: E402
from procpipe._ext import cpu_budget  # noqa: E402
from procpipe.bench.workloads import WORKLOADS, resolve  # noqa: E402


def consume(
    workers: Any, name: str, seconds: float, warmup: float, every: float | None = None, start_at: float | None = None
) -> dict[str, Any]:
    """One loader of workload ``name``: samples/s over ``seconds`` after ``warmup`` (measured from the
    first batch, or from ``start_at``, a ``time.time()`` shared by ranks); with ``every``, the rate
    and worker count in each ``every`` seconds."""
    w = WORKLOADS[name]
    loader = procpipe.Loader(w.dataset(quick=True), batch_size=w.batch_size, workers=workers, epochs=None, shuffle=True)
    series = []
    try:
        it = iter(loader)
        next(it)
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        begin, end = t0 + warmup, t0 + warmup + seconds
        counted = 0
        bucket_t, bucket_n = t0, 0
        for batch in it:
            n = len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch)
            del batch
            now = time.perf_counter()
            if now >= begin:
                counted += n
            bucket_n += n
            if every and now - bucket_t >= every:
                series.append((round(now - t0, 1), bucket_n / (now - bucket_t), loader.stats()["workers"]))
                bucket_t, bucket_n = now, 0
            if now >= end:
                break
        stats = loader.stats()
    finally:
        loader.close()
    return {
        "samples_per_s": counted / seconds,
        "series": series,
        "workers": stats["workers"],
        "autotune": {k: v for k, v in (stats["autotune"] or {}).items() if k != "trace"},
    }


def ranks(workers: Any, name: str, n: int, seconds: float, settle: float) -> dict[str, Any]:
    """``n`` processes, each one loader (a DDP job's ranks on one node), measured over the same window."""
    start_at = time.time() + 5.0 + 0.5 * n  # every rank has built its loader and has its first batch by then
    spec = json.dumps({"workers": workers, "name": name, "seconds": seconds, "warmup": settle, "start_at": start_at})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", spec], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(n)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a rank failed (exit {p.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {"samples_per_s": sum(r["samples_per_s"] for r in results), "workers": [r["workers"] for r in results]}


def plan(budget: int, quick: bool) -> dict[str, Any]:
    if quick:
        fixed = sorted({1, 2, 4, budget})
        n_ranks = max(2, min(4, budget))
        return {
            "fixed": fixed,
            "auto_s": 20.0,
            "fixed_s": 8.0,
            "rank_s": 20.0,
            "settle": 10.0,
            "warmup": 2.0,
            "ranks": n_ranks,
            "split": max(1, budget // n_ranks),
            "over": max(2, budget - 1),
        }
    fixed = sorted({1, 2, 4, 8, max(1, budget - 1), budget})
    return {
        "fixed": fixed,
        "auto_s": 60.0,
        "fixed_s": 15.0,
        "rank_s": 30.0,
        "settle": 15.0,
        "warmup": 3.0,
        "ranks": 4,
        "split": max(1, budget // 4),
        "over": max(2, budget - 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="cpu,straggler")
    p.add_argument("--quick", action="store_true", help="the scaled-down lists and runs (automatic below 8 CPUs)")
    p.add_argument("--auto-seconds", type=float)
    p.add_argument("--fixed-seconds", type=float)
    p.add_argument("--rank-seconds", type=float)
    p.add_argument("--settle", type=float, help="seconds auto gets before its rate counts")
    p.add_argument("--ranks", type=int)
    p.add_argument("--every", type=float, default=5.0, help="auto's series: one line per this many seconds")
    p.add_argument("--reps", type=int, default=1, help="one-loader repetitions, settings rotating (medians)")
    p.add_argument("--no-ranks", action="store_true", help="only the one-loader part")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--child", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.child:  # one rank
        spec = json.loads(opts.child)
        r = consume(spec["workers"], spec["name"], spec["seconds"], spec["warmup"], start_at=spec["start_at"])
        print(json.dumps({"samples_per_s": r["samples_per_s"], "workers": r["workers"]}))
        return 0
    budget = cpu_budget()
    quick = opts.quick or budget < 8
    cfg = plan(budget, quick)
    for key, value in (
        ("auto_s", opts.auto_seconds),
        ("fixed_s", opts.fixed_seconds),
        ("rank_s", opts.rank_seconds),
        ("settle", opts.settle),
        ("ranks", opts.ranks),
    ):
        if value is not None:
            cfg[key] = value
    if opts.ranks:
        cfg["split"] = max(1, budget // opts.ranks)
    print(
        f"procpipe {procpipe.__version__}, python {platform.python_version()}, CPU budget {budget} "
        f"(os.cpu_count() {os.cpu_count()}), load average {os.getloadavg()[0]:.1f}; "
        f"{'quick' if quick else 'full'}: {json.dumps(cfg)}",
        flush=True,
    )
    report: dict[str, Any] = {"budget": budget, "cpu_count": os.cpu_count(), "config": cfg, "workloads": {}}
    summary = []
    for name in resolve(opts.workloads):
        print(f"\n== {name}: {WORKLOADS[name].description}", flush=True)
        runs: dict[Any, list[float]] = {n: [] for n in [*cfg["fixed"], "auto"]}
        settings = list(runs)
        autos = []
        for rep in range(opts.reps):  # settings rotate between repetitions: drift hits them alike
            k = rep % len(settings)
            for setting in settings[k:] + settings[:k]:
                if setting == "auto":
                    auto = consume("auto", name, cfg["auto_s"] - cfg["settle"], cfg["settle"], every=opts.every)
                    for t, rate, workers in auto["series"]:
                        print(f"  auto  t={t:5.1f} s  {rate:10,.0f} samples/s  workers={workers}", flush=True)
                    print(f"  auto after {cfg['settle']:g} s: {auto['samples_per_s']:10,.0f} samples/s", flush=True)
                    autos.append(auto)
                    runs["auto"].append(auto["samples_per_s"])
                else:
                    rate = consume(setting, name, cfg["fixed_s"], cfg["warmup"])["samples_per_s"]
                    runs[setting].append(rate)
                    print(f"  workers={setting:<3d} {rate:10,.0f} samples/s", flush=True)
        med = {s_: statistics.median(v) for s_, v in runs.items()}
        fixed = {n: med[n] for n in cfg["fixed"]}
        auto = {**autos[-1], "samples_per_s": med["auto"]}
        best = max(fixed, key=lambda k: fixed[k])
        r_best = auto["samples_per_s"] / fixed[best]
        r_two = auto["samples_per_s"] / fixed[2] if 2 in fixed else float("nan")
        print(f"  medians of {opts.reps}: " + ", ".join(f"{s_}: {v:,.0f}" for s_, v in med.items()), flush=True)
        print(
            f"  auto after {cfg['settle']:g} s: {auto['samples_per_s']:,.0f} samples/s = {r_best:.2f} of the best "
            f"fixed count ({best}), {r_two:.2f} of workers=2; last run's final workers {auto['workers']}; "
            f"{auto['autotune']}",
            flush=True,
        )
        entry: dict[str, Any] = {
            "runs": runs,
            "medians": med,
            "auto_last": autos[-1],
            "auto_over_best": r_best,
            "auto_over_two": r_two,
        }
        summary.append(
            (
                name,
                "one loader",
                f"auto {auto['samples_per_s']:,.0f}",
                f"best fixed ({best}) {fixed[best]:,.0f}",
                f"{r_best:.2f}",
                f"vs workers=2: {r_two:.2f}",
            )
        )
        if not opts.no_ranks:
            k = cfg["ranks"]
            rows = {}
            for label, workers in (
                ("auto", "auto"),
                (f"fixed {cfg['split']}", cfg["split"]),
                (f"fixed {cfg['over']}", cfg["over"]),
            ):
                rows[label] = ranks(workers, name, k, cfg["rank_s"], cfg["settle"])
                print(
                    f"  {k} ranks x {label:9s} {rows[label]['samples_per_s']:10,.0f} samples/s in all, "
                    f"workers {rows[label]['workers']}",
                    flush=True,
                )
            split = rows[f"fixed {cfg['split']}"]["samples_per_s"]
            ratio = rows["auto"]["samples_per_s"] / split
            over = rows[f"fixed {cfg['over']}"]["samples_per_s"] / split
            print(
                f"  {k} ranks: auto / fixed {cfg['split']} = {ratio:.2f}; fixed {cfg['over']} / fixed "
                f"{cfg['split']} = {over:.2f}",
                flush=True,
            )
            entry["ranks"] = rows
            summary.append(
                (
                    name,
                    f"{k} ranks",
                    f"auto {rows['auto']['samples_per_s']:,.0f}",
                    f"{k} x fixed {cfg['split']} {split:,.0f}",
                    f"{ratio:.2f}",
                    f"{k} x fixed {cfg['over']}: {over:.2f}",
                )
            )
        report["workloads"][name] = entry
    print("\n| workload | setting | auto samples/s | baseline samples/s | auto / baseline | also |")
    print("|---|---|---|---|---|---|")
    for row in summary:
        print("| " + " | ".join(row) + " |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
