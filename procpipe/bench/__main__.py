"""``python -m procpipe.bench`` / ``procpipe-bench``: how many workers should my pipeline use?

With no arguments, sweeps the worker count on the built-in reference workloads (cpu,
transfer, straggler, tiny with batch 1 and 64) at a quick size and prints a table per
workload. With ``--pipeline module:factory``, sweeps your own pipeline: ``factory`` returns
the ``procpipe.Loader`` keyword arguments (a dict; ``workers`` is set by the sweep) or a
ready ``Loader`` (then it must accept a ``workers=`` argument).

Per worker count it prints samples/s, batches/s, MB/s, the % of time the training loop
waited in ``next()``, the workers' mean busy %, their peak RSS and the time to the first
batch, then a recommendation and its reason. ``--step-ms`` models the training step
(``--step-mode sleep``: a GPU step, the process idle; ``busy``: a CPU step holding the GIL).

Examples::

    python -m procpipe.bench
    python -m procpipe.bench --workloads cpu,straggler --workers 0,2,4 --json out.json --plot out.png
    python -m procpipe.bench --pipeline mytrain.data:loader_kwargs --step-ms 30
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import sys
from collections.abc import Callable, Mapping
from typing import Any

from . import sweep
from .workloads import WORKLOADS, resolve


def _parse_workers(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers takes comma-separated integers like 0,1,2, got {text!r}") from None
    if not counts or counts[0] < 0:
        raise argparse.ArgumentTypeError(f"--workers takes integers >= 0, got {text!r}")
    return counts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="procpipe-bench",
        description="Sweep procpipe's worker count on the reference workloads or on your own pipeline, "
                    "and recommend one.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="JSON fields and every column are documented in README.md (section: python -m procpipe.bench).",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--pipeline", metavar="MODULE:FACTORY",
                     help="your pipeline: FACTORY() returns Loader keyword arguments (dict) or a Loader "
                          "(then it must take workers=); the module is imported from the current directory too")
    src.add_argument("--workloads", metavar="NAMES",
                     help=f"built-in workloads, comma-separated (default: all): {', '.join(WORKLOADS)}, tiny")
    p.add_argument("--workers", type=_parse_workers, metavar="N,N,...",
                   help="worker counts to try (default: 0, 1, 2, ... up to 2x the CPU count)")
    p.add_argument("--size", type=int, metavar="SAMPLES", help="samples per built-in workload (default: a quick size)")
    p.add_argument("--full", action="store_true", help="built-in workloads at their full size (slower)")
    p.add_argument("--step-ms", type=float, default=0.0, metavar="MS",
                   help="time the training loop spends per batch (default 0: measure the pipeline alone)")
    p.add_argument("--step-mode", choices=("sleep", "busy"), default="sleep",
                   help="how the step is spent: sleep (a GPU step; default) or busy-wait (a CPU step)")
    p.add_argument("--seconds", type=float, default=10.0, metavar="S",
                   help="stop measuring one worker count after S seconds (default 10)")
    p.add_argument("--batches", type=int, metavar="N", help="stop measuring one worker count after N batches")
    p.add_argument("--within", type=float, default=0.95, metavar="F",
                   help="recommend the fewest workers within this fraction of the best throughput (default 0.95)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="chart throughput and wait %% against workers (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is shown on a terminal only)")
    return p


def load_factory(spec: str) -> Callable[..., Any]:
    """``"package.module:name"`` -> the object, importing from the current directory too."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"--pipeline takes MODULE:FACTORY (e.g. mytrain.data:make_loader), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"--pipeline: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SystemExit(f"--pipeline: module {module_name!r} has no {attr!r}") from None
    if not callable(obj):
        raise SystemExit(f"--pipeline: {spec} is not callable")
    return obj


def loader_maker(factory: Callable[..., Any]) -> Callable[[int], Any]:
    """A ``workers -> Loader`` function from a factory returning kwargs or a Loader."""
    from procpipe import Loader

    try:
        params = inspect.signature(factory).parameters
        takes_workers = "workers" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        takes_workers = False

    def make(workers: int) -> Any:
        made = factory(workers=workers) if takes_workers else factory()
        if isinstance(made, Loader):
            if made._workers != workers:
                made.close()
                raise SystemExit(
                    f"--pipeline factory returned a Loader with {made._workers} workers where {workers} were asked: "
                    "to sweep the worker count it must take a workers= argument, or return the Loader's keyword "
                    "arguments as a dict instead")
            return made
        if isinstance(made, Mapping):
            kwargs = dict(made)
            kwargs["workers"] = workers
            return Loader(**kwargs)
        raise SystemExit(f"--pipeline factory must return a dict of Loader arguments or a Loader, "
                         f"got {type(made).__name__}")

    return make


def _builtin_maker(name: str, size: int | None, full: bool) -> tuple[Callable[[int], Any], str]:
    from procpipe import Loader

    w = WORKLOADS[name]
    dataset = w.dataset(size, quick=not full)

    def make(workers: int) -> Any:
        return Loader(dataset, batch_size=w.batch_size, workers=workers)

    return make, f"{w.description}; {len(dataset)} samples, batch {w.batch_size}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    counts = args.workers or sweep.default_worker_counts()
    step_s = max(0.0, args.step_ms) / 1e3
    if args.pipeline:
        factory = load_factory(args.pipeline)
        jobs = [(args.pipeline, loader_maker(factory), f"pipeline {args.pipeline}")]
    else:
        try:
            names = resolve(args.workloads)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        jobs = [(n, *_builtin_maker(n, args.size, args.full)) for n in names]

    from tqdm import tqdm

    bar = tqdm(total=len(jobs) * len(counts), unit="setting", disable=True if args.no_progress else None,
               leave=False, dynamic_ncols=True)
    out = tqdm.write
    cpus = sweep.cpu_count()
    out(f"procpipe bench: {cpus} CPUs, workers {','.join(map(str, counts))}"
        + (f", training step {args.step_ms:g} ms ({args.step_mode})" if step_s else ", no training step"))
    runs = []
    try:
        for name, make, description in jobs:
            settings = []
            for workers in counts:
                done = [0]

                def progress(n: int, name: str = name, workers: int = workers, done: list = done) -> None:
                    done[0] += n
                    bar.set_postfix_str(f"{name}, {workers} workers, {done[0]} batches", refresh=False)
                    bar.update(0)  # redraws at most every bar.mininterval

                progress(0)
                settings.append(sweep.measure(make, workers, step_s=step_s, step_mode=args.step_mode,
                                              max_batches=args.batches, max_seconds=args.seconds,
                                              progress=None if bar.disable else progress))
                bar.update(1)
            rec = sweep.recommend(settings, within=args.within, step_s=step_s, cpus=cpus)
            out(f"\n== {name}: {description}\n{sweep.format_table(settings)}\n{rec['text']}.\n  why: {rec['why']}.")
            runs.append({"name": name, "description": description,
                         "settings": [s.to_json() for s in settings], "recommendation": rec})
    finally:
        bar.close()
    if len(runs) > 1:
        print("\nsummary:")
        for run in runs:
            print(f"  {run['name']:>12}: {run['recommendation']['text']}")
    if args.json:
        from procpipe import __version__

        document = {
            "procpipe_version": __version__, "python": platform.python_version(), "cpu_count": cpus,
            "argv": sys.argv[1:] if argv is None else list(argv), "workers": counts,
            "step_ms": args.step_ms, "step_mode": args.step_mode, "within": args.within, "runs": runs,
        }
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        sweep.plot(runs, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
