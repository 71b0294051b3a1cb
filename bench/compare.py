"""procpipe beside PyTorch's DataLoader, ``multiprocessing.Pool.imap`` and a serial loop (and
tf.data's recipes and Keras' PyDataset with ``--workloads tf``: bench/tf_recipes.py).

Runs each reference workload (defined once, in ``procpipe/bench/workloads.py``) with
every engine, in one process, alternating the engines within each repetition (the order
rotates between repetitions) so that drift on a noisy machine hits all of them alike, and
prints the medians and one row per performance goal (README.md, "Performance goals"):
both sides, their ratio, and whether the goal is met. Goals are reported, never asserted.

    python bench/compare.py                    # every workload, 5 repetitions
    python bench/compare.py --quick            # fewer repetitions, smaller sizes (~1 min)
    python bench/compare.py --workloads cpu,tiny --json out.json
    python bench/compare.py --workloads tf --workers 2   # tf_cpu, tf_transfer (needs tensorflow, keras)

Fairness: same worker count (``--workers``, default the CPU count), same batch size,
and at least as many batches in flight: procpipe keeps ``prefetch + 2 * workers``
batches outstanding (``prefetch + 4 * workers`` for batches up to 1 MiB), so the
DataLoader gets ``prefetch_factor = ceil((prefetch + 4 * workers) / workers)`` everywhere.
Throughput is measured over the end of one epoch: after the first batch (start-up is
the separate "first batch" row) and a warm-up of as many batches as procpipe keeps in
flight (``prefetch + 4 * workers``), the same for every engine; the consumer does not
touch the data. DataLoader and
Pool use ``fork``; procpipe the fork-safe forkserver (what its ``"auto"`` default picks in a
process running threads; ``bench/cold_start.py`` measures the default in a fresh script).
PyTorch is optional (``pip install torch``, the bench extra): without it the DataLoader
column is empty and the rows that need it say so.

Extending: ``RUNNERS`` below is a plain dict ``name -> runner``. A runner takes the
parsed :class:`Options` and returns a :class:`WorkloadResult` (the medians of each engine
and any target rows); :func:`alternate` does the alternating repetitions and the engine
functions (:func:`procpipe_engine`, :func:`dataloader_engine`, :func:`pool_engine`,
:func:`serial_engine`) time one epoch each. To add a workload (a fault-tolerance
scenario, say), write ``def run_mine(opts) -> WorkloadResult`` and add
``RUNNERS["mine"] = run_mine``; ``--workloads mine`` then runs it and its rows appear in
both tables and the JSON.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import multiprocessing
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from procpipe import Loader, __version__
from procpipe._engine.coordinator import TASKS_PER_WORKER_SMALL
from procpipe.bench.sweep import cpu_count
from procpipe.bench.workloads import WORKLOADS, StragglerDataset, TinyDataset, load_batch

PREFETCH = 2  # procpipe's default prefetch; the DataLoader's prefetch_factor is matched to it

# Samples per workload: (quick, full).
SIZES = {
    "cpu": (500, 1200),
    "transfer": (64 * 40, 64 * 120),
    "straggler": (360, 900),
    "tiny1": (1000, 3000),
    "tiny64": (64 * 800, 64 * 2000),
    "first_batch": (64 * 4, 64 * 4),
    "tf_cpu": (1280, 3200),
    "tf_transfer": (64 * 60, 64 * 150),
}


@dataclass
class Options:
    workers: int
    reps: int
    quick: bool
    verbose: bool = True

    def size(self, name: str) -> int:
        quick, full = SIZES[name]
        return quick if self.quick else full


@dataclass
class Measurement:
    """One timed epoch of one engine."""

    first_batch_s: float  # from creating the loader to the first batch in hand
    seconds: float  # from the first batch to the end of the epoch
    batches: int  # batches after the first
    samples: int  # samples after the first batch

    def rate(self, unit: str, sample_bytes: int = 0) -> float:
        if unit == "batches/s":
            return self.batches / self.seconds
        if unit == "GB/s":
            return self.samples * sample_bytes / self.seconds / 1e9
        if unit == "s":
            return self.first_batch_s
        return self.samples / self.seconds


@dataclass
class EngineResult:
    engine: str
    values: list[float]  # one per repetition, in ``unit``
    first_batch_s: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan


@dataclass
class Target:
    """A performance-goal row: procpipe beside its reference, the ratio and the bar it must clear."""

    name: str
    procpipe: float
    reference: float
    reference_name: str
    unit: str
    need: float  # the ratio procpipe/reference must reach (or not exceed, if at_most)
    at_most: bool = False
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.procpipe / self.reference if self.reference else math.nan

    @property
    def met(self) -> bool | None:
        if math.isnan(self.ratio):
            return None
        return self.ratio <= self.need if self.at_most else self.ratio >= self.need

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "met": self.met}


@dataclass
class WorkloadResult:
    name: str
    unit: str
    size: int
    description: str
    engines: dict[str, EngineResult] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)

    def median(self, engine: str) -> float:
        r = self.engines.get(engine)
        return r.median if r is not None else math.nan


# ------------------------------------------------------------------------------ engines
def _batches(n: int, batch_size: int) -> list[list[int]]:
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


def warmup_batches(workers: int) -> int:
    """Batches left out of the throughput window after the first: as many as procpipe has in flight."""
    return PREFETCH + TASKS_PER_WORKER_SMALL * workers


def _consume(iterator: Any, t0: float, n: int, batch_size: int, warmup: int) -> Measurement:
    first = next(iterator)
    first_batch_s = time.perf_counter() - t0
    del first
    skipped = 1
    for batch in iterator:  # warm-up: every engine's pipeline fills up (procpipe: ring sized and touched)
        del batch
        skipped += 1
        if skipped > warmup:
            break
    t1 = time.perf_counter()
    count = 0
    for batch in iterator:
        count += 1
        del batch
    t2 = time.perf_counter()
    return Measurement(first_batch_s, max(t2 - t1, 1e-9), count, max(0, n - min(n, skipped * batch_size)))


def procpipe_engine(
    source: Any, batch_size: int, workers: int, *, ordered: bool = True, **loader_kwargs: Any
) -> Measurement:
    t0 = time.perf_counter()
    loader_kwargs.setdefault("start_method", "forkserver")
    with Loader(
        source, batch_size=batch_size, workers=workers, ordered=ordered, prefetch=PREFETCH, **loader_kwargs
    ) as loader:
        return _consume(iter(loader), t0, len(source), batch_size, warmup_batches(workers))


def dataloader_prefetch_factor(workers: int) -> int:
    return max(1, math.ceil((PREFETCH + TASKS_PER_WORKER_SMALL * workers) / max(1, workers)))


def dataloader_engine(source: Any, batch_size: int, workers: int) -> Measurement:
    from torch.utils.data import DataLoader

    t0 = time.perf_counter()
    dl = DataLoader(
        source,
        batch_size=batch_size,
        num_workers=workers,
        prefetch_factor=dataloader_prefetch_factor(workers) if workers else None,
        multiprocessing_context="fork" if workers else None,
    )
    it = iter(dl)
    try:
        return _consume(it, t0, len(source), batch_size, warmup_batches(workers))
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del it


_pool_source: Any = None


def _pool_init(source: Any) -> None:
    global _pool_source  # noqa: PLW0603 -- a multiprocessing.Pool initializer hands each process its source
    _pool_source = source


def _pool_batch(indices: list[int]) -> Any:
    return load_batch(_pool_source, indices)


def pool_engine(source: Any, batch_size: int, workers: int) -> Measurement:
    ctx = multiprocessing.get_context("fork")
    t0 = time.perf_counter()
    with ctx.Pool(workers, initializer=_pool_init, initargs=(source,)) as pool:
        it = pool.imap(_pool_batch, _batches(len(source), batch_size), chunksize=1)
        return _consume(it, t0, len(source), batch_size, warmup_batches(workers))


def serial_engine(source: Any, batch_size: int, warmup: int = 0) -> Measurement:
    t0 = time.perf_counter()
    it = (load_batch(source, b) for b in _batches(len(source), batch_size))
    return _consume(it, t0, len(source), batch_size, warmup)


def have_torch() -> bool:
    try:
        import torch.utils.data  # noqa: F401
    except ImportError:
        return False
    return True


def alternate(
    engines: dict[str, Callable[[], Measurement]], reps: int, unit: str, sample_bytes: int = 0, label: str = ""
) -> dict[str, EngineResult]:
    """Run every engine once per repetition, rotating their order; collect each one's rates."""
    names = list(engines)
    results = {n: EngineResult(n, [], []) for n in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            gc.collect()
            m = engines[name]()
            results[name].values.append(m.rate(unit, sample_bytes))
            results[name].first_batch_s.append(m.first_batch_s)
        print(
            f"  {label} rep {rep + 1}/{reps}: " + ", ".join(f"{n} {results[n].values[-1]:,.3g}" for n in names),
            file=sys.stderr,
            flush=True,
        )
    return results


def _standard_engines(name: str, opts: Options, source: Any) -> dict[str, Callable[[], Measurement]]:
    bs, w = WORKLOADS[name].batch_size, opts.workers
    engines: dict[str, Callable[[], Measurement]] = {"procpipe": lambda: procpipe_engine(source, bs, w)}
    if have_torch():
        engines["DataLoader"] = lambda: dataloader_engine(source, bs, w)
    engines["Pool.imap"] = lambda: pool_engine(source, bs, w)
    engines["serial"] = lambda: serial_engine(source, bs, warmup_batches(w))
    return engines


def _result(name: str, opts: Options, engines: dict[str, Callable[[], Measurement]]) -> WorkloadResult:
    wl = WORKLOADS[name]
    size = opts.size(name)
    res = WorkloadResult(name, wl.unit, size, wl.description)
    res.engines = alternate(engines, opts.reps, wl.unit, wl.sample_bytes, label=name)
    return res


# ------------------------------------------------------------------------------ runners
def run_cpu(opts: Options) -> WorkloadResult:
    source = WORKLOADS["cpu"].dataset(opts.size("cpu"))
    res = _result("cpu", opts, _standard_engines("cpu", opts, source))
    res.targets.append(
        Target(
            "cpu: procpipe vs serial",
            res.median("procpipe"),
            res.median("serial"),
            "serial",
            res.unit,
            1.8,
            note=f"2-core ideal is 2x; {opts.workers} workers",
        )
    )
    res.targets.append(
        Target(
            "cpu: procpipe vs DataLoader", res.median("procpipe"), res.median("DataLoader"), "DataLoader", res.unit, 1.3
        )
    )
    return res


def run_transfer(opts: Options) -> WorkloadResult:
    source = WORKLOADS["transfer"].dataset(opts.size("transfer"))
    res = _result("transfer", opts, _standard_engines("transfer", opts, source))
    res.targets.append(
        Target(
            "transfer: procpipe vs DataLoader",
            res.median("procpipe"),
            res.median("DataLoader"),
            "DataLoader",
            "GB/s",
            5.0,
        )
    )
    res.targets.append(Target("transfer: procpipe vs 4 GB/s", res.median("procpipe"), 4.0, "4 GB/s", "GB/s", 1.0))
    return res


def run_straggler(opts: Options) -> WorkloadResult:
    name, w = "straggler", opts.workers
    source = WORKLOADS[name].dataset(opts.size(name))
    bs = WORKLOADS[name].batch_size
    engines = _standard_engines(name, opts, source)
    engines["procpipe sloppy"] = lambda: procpipe_engine(source, bs, w, ordered=False)
    res = _result(name, opts, engines)
    ideal = w * res.median("serial")  # the measured per-sample time, w of them at once
    nominal = w / StragglerDataset(1).mean_sample_s
    res.targets.append(
        Target(
            "straggler: procpipe (ordered=False) vs ideal",
            res.median("procpipe sloppy"),
            ideal,
            f"{w} x serial",
            res.unit,
            0.9,
            note=f"ideal = {w} workers x serial rate measured in this run (nominal sleeps alone: {nominal:,.0f}/s)",
        )
    )
    res.targets.append(
        Target("straggler: procpipe (ordered) vs ideal", res.median("procpipe"), ideal, f"{w} x serial", res.unit, 0.9)
    )
    return res


def _run_tiny(name: str, opts: Options) -> WorkloadResult:
    source = WORKLOADS[name].dataset(opts.size(name))
    res = _result(name, opts, _standard_engines(name, opts, source))
    res.targets.append(
        Target(
            f"{name}: procpipe vs DataLoader",
            res.median("procpipe"),
            res.median("DataLoader"),
            "DataLoader",
            res.unit,
            5.0,
        )
    )
    return res


def run_tiny1(opts: Options) -> WorkloadResult:
    return _run_tiny("tiny1", opts)


def run_tiny64(opts: Options) -> WorkloadResult:
    return _run_tiny("tiny64", opts)


_procpipe_cold: list[float] = []  # the first procpipe loader of the process, if first_batch made it


def run_first_batch(opts: Options) -> WorkloadResult:
    """Time from creating the loader to the first batch in hand (tiny dataset, batch 64, warm)."""
    size, w, bs = opts.size("first_batch"), opts.workers, 64
    source = TinyDataset(size)
    engines: dict[str, Callable[[], Measurement]] = {"procpipe": lambda: procpipe_engine(source, bs, w)}
    if have_torch():
        engines["DataLoader"] = lambda: dataloader_engine(source, bs, w)
    engines["procpipe fork"] = lambda: procpipe_engine(source, bs, w, start_method="fork")
    # Cold: the first procpipe loader of a process also starts the forkserver (which imports
    # what the parent imported, torch included). Reported apart, once.
    cold = procpipe_engine(source, bs, w).first_batch_s
    res = WorkloadResult(
        "first_batch",
        "s",
        size,
        "seconds from Loader()/DataLoader() to the first batch (lower is better); tiny dataset, batch 64",
    )
    res.engines = alternate(engines, max(opts.reps, 5), "s", label="first_batch")
    res.engines["procpipe cold"] = EngineResult("procpipe cold", [cold], [cold])
    res.targets.append(
        Target(
            "first batch: procpipe vs DataLoader (fork)",
            res.median("procpipe"),
            res.median("DataLoader"),
            "DataLoader fork",
            "s",
            1.5,
            at_most=True,
            note=f"warm forkserver; the process's very first loader took {cold:.3f} s",
        )
    )
    return res


def run_tf(name: str, opts: Options) -> WorkloadResult:
    """procpipe into TensorFlow beside tf.data's recipes and Keras' PyDataset (bench/tf_recipes.py)."""
    import tf_recipes

    source, bs, unit, sample_bytes, description = tf_recipes.workload(name, opts.size(name))
    n, warm, res = len(source), warmup_batches(opts.workers), WorkloadResult(name, unit, len(source), description)
    tf_recipes.CPU_MS.clear()
    with tf_recipes.engines(source, bs, opts.workers, PREFETCH) as passes:  # built once, outside the timing
        res.engines = alternate(
            {
                label: (lambda label=label, p=p: tf_recipes.consume(label, p, _consume, n, bs, warm))
                for label, p in passes.items()
            },
            opts.reps,
            unit,
            sample_bytes,
            label=name,
        )
    for ref, need, note in tf_recipes.GOALS[name]:
        res.targets.append(
            Target(
                f"{name}: procpipe->tf vs {ref}",
                res.median("procpipe->tf"),
                res.median(ref),
                ref,
                unit,
                need,
                note=note,
            )
        )
    res.targets += [Target(t, a, b, "procpipe", "ms", m, True, note) for t, a, b, m, note in tf_recipes.cpu_rows(name)]
    return res


RUNNERS: dict[str, Callable[[Options], WorkloadResult]] = {
    "first_batch": run_first_batch,
    "cpu": run_cpu,
    "transfer": run_transfer,
    "straggler": run_straggler,
    "tiny1": run_tiny1,
    "tiny64": run_tiny64,
}
if importlib.util.find_spec("tensorflow") and importlib.util.find_spec("keras"):  # bench/tf_recipes.py
    RUNNERS.update({n: (lambda opts, n=n: run_tf(n, opts)) for n in ("tf_cpu", "tf_transfer")})
ALIASES = {"tiny": ("tiny1", "tiny64"), "first": ("first_batch",), "tf": ("tf_cpu", "tf_transfer")}


# ------------------------------------------------------------------------------ output
ENGINE_ORDER = [
    "procpipe",
    "procpipe sloppy",
    "procpipe fork",
    "procpipe cold",
    "DataLoader",
    "Pool.imap",
    "serial",
    "procpipe->tf",
    "tf py_function",
    "tf from_generator",
    "PyDataset mp",
]


def _fmt(v: float) -> str:
    if v is None or math.isnan(v):
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}" if abs(v) >= 0.01 else f"{v:.4f}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def results_table(results: list[WorkloadResult]) -> str:
    engines = [e for e in ENGINE_ORDER if any(e in r.engines for r in results)]
    engines += sorted({e for r in results for e in r.engines} - set(engines))
    rows = [["workload", "unit", *engines, "procpipe/DataLoader"]]
    for r in results:
        ratio = r.median("procpipe") / r.median("DataLoader") if "DataLoader" in r.engines else math.nan
        rows.append(
            [
                r.name,
                r.unit,
                *[_fmt(r.median(e)) if e in r.engines else "-" for e in engines],
                "-" if math.isnan(ratio) else f"{ratio:.2f}x",
            ]
        )
    return _table(rows)


def targets_table(results: list[WorkloadResult]) -> str:
    rows = [["target", "procpipe", "reference", "ratio", "needed", "target met?"]]
    for r in results:
        for t in r.targets:
            met = {True: "yes", False: "NO", None: "n/a"}[t.met]
            rows.append(
                [
                    t.name,
                    f"{_fmt(t.procpipe)} {t.unit}",
                    f"{_fmt(t.reference)} ({t.reference_name})",
                    "-" if math.isnan(t.ratio) else f"{t.ratio:.2f}x",
                    f"{'<=' if t.at_most else '>='} {t.need:g}x",
                    met,
                ]
            )
    return _table(rows)


def resolve(names: str | None) -> list[str]:
    if not names:
        return list(RUNNERS)
    out: list[str] = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        for n in ALIASES.get(name, (name,)):
            if n not in RUNNERS:
                raise SystemExit(f"unknown workload {name!r}; choose from {', '.join([*RUNNERS, *ALIASES])}")
            if n not in out:
                out.append(n)
    if "first_batch" in out:  # first, so that its cold start is the process's first loader
        out.remove("first_batch")
        out.insert(0, "first_batch")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="procpipe beside DataLoader, Pool.imap and serial, with the performance-goal rows."
    )
    p.add_argument("--quick", action="store_true", help="3 repetitions and smaller sizes")
    p.add_argument("--reps", type=int, help="repetitions per engine (default 5, or 3 with --quick)")
    p.add_argument("--workloads", metavar="A,B", help=f"subset to run: {', '.join([*RUNNERS, *ALIASES])}")
    p.add_argument("--workers", type=int, default=cpu_count(), help="workers for every engine (default: CPU count)")
    p.add_argument("--json", metavar="FILE", help="write every measurement and target row as JSON")
    args = p.parse_args(argv)
    opts = Options(workers=max(1, args.workers), reps=args.reps or (3 if args.quick else 5), quick=args.quick)
    names = resolve(args.workloads)
    torch_version = None
    if have_torch():
        import torch

        torch_version = torch.__version__
    else:
        print("PyTorch is not installed: the DataLoader column stays empty (pip install torch).", file=sys.stderr)
    print(
        f"procpipe {__version__} | torch {torch_version} | {cpu_count()} CPUs | {opts.workers} workers | "
        f"{opts.reps} reps | {'quick' if opts.quick else 'full'} sizes | prefetch {PREFETCH} "
        f"(DataLoader prefetch_factor {dataloader_prefetch_factor(opts.workers)})",
        flush=True,
    )
    started = time.perf_counter()
    results = [RUNNERS[n](opts) for n in names]
    print("\nmedians (higher is better, except first_batch in seconds):")
    print(results_table(results))
    print('\nperformance goals (ratios measured in this run; README.md, "Performance goals"):')
    print(targets_table(results))
    print(f"\n{time.perf_counter() - started:.0f} s")
    if args.json:
        doc = {
            "procpipe_version": __version__,
            "torch_version": torch_version,
            "python": platform.python_version(),
            "cpu_count": cpu_count(),
            "workers": opts.workers,
            "reps": opts.reps,
            "quick": opts.quick,
            "prefetch": PREFETCH,
            "dataloader_prefetch_factor": dataloader_prefetch_factor(opts.workers),
            "workloads": {
                r.name: {
                    "unit": r.unit,
                    "size": r.size,
                    "description": r.description,
                    "engines": {
                        e: {"median": v.median, "values": v.values, "first_batch_s": v.first_batch_s}
                        for e, v in r.engines.items()
                    },
                }
                for r in results
            },
            "targets": [t.to_json() for r in results for t in r.targets],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
