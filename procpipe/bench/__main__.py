"""``python -m procpipe.bench`` / ``procpipe-bench``: how many workers should my pipeline use?

With no arguments, sweeps the worker count on the built-in reference workloads (cpu,
transfer, straggler, tiny with batch 1 and 64) in about a minute (``--budget``) and prints
one line of advice per workload; ``--table`` adds each workload's table and the reasoning.
With ``--pipeline module:factory``, sweeps your own pipeline (``FACTORY_HELP``
below: the factory's contract, with an example), a ``procpipe.Loader`` or a
``procpipe.torch.DataLoader`` (its ``num_workers``).

Each worker count is measured ``--repeat`` times (default 3, the counts taken in turn so
that a passing load hits them alike), each time across epochs until its budget is spent
(``--seconds``, by default the ``--budget`` shared out; ``--batches``); the table gives the
median run and the spread of samples/s. Per worker count it prints samples/s, its spread, batches/s, MB/s, the % of
time the training loop waited in ``next()``, the workers' mean busy % and CPU %, the %
of time they waited for a CPU held by another process (run queue; ``!``: contended), their
private memory (USS: the shared ring is not counted) and the time to the first batch, then
a recommendation and its reason. ``--step-ms`` models the training step (``--step-mode
sleep``: a GPU step, the process idle; ``busy``: a CPU step holding the GIL).

Examples::

    python -m procpipe.bench
    python -m procpipe.bench --table
    python -m procpipe.bench --workloads cpu,straggler --workers 0,2,4 --json out.json --plot out.png
    python -m procpipe.bench --pipeline mytrain.data:loader_kwargs --step-ms 30
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from typing import Any

from . import sweep
from .pipeline import PipelineMaker, failed, load_factory, loader_maker
from .workloads import WORKLOADS, resolve

__all__ = ["PipelineMaker", "build_parser", "load_factory", "loader_maker", "main"]

DOCS = "docs/benchmarks.md"  # the bench's page (tests/test_bench.py checks every doc reference the CLI prints)
OWN_PIPELINE = (
    "To measure your own pipeline: python -m procpipe.bench --pipeline MODULE:FACTORY, where FACTORY() returns "
    "your Loader's or DataLoader's keyword arguments as a dict (--help: the contract and an example; "
    f"{DOCS}#your-own-pipeline); add --step-ms with your training step's time."
)
FACTORY_HELP = """\
--pipeline MODULE:FACTORY, the factory's contract:
  FACTORY() (or FACTORY(workers=N), if it takes workers) returns one of
  - a dict of procpipe.Loader keyword arguments (source, fn, batch_size, ...): the bench
    sets workers;
  - a dict of procpipe.torch.DataLoader keyword arguments (it has a "dataset" key): the
    bench sets num_workers;
  - a ready procpipe.Loader or procpipe.torch.DataLoader: then FACTORY must take workers=
    and build it with that many workers.
  MODULE is imported from the current directory too. Example, mytrain/data.py:

      import numpy as np

      class Images:                        # any object with __len__ and __getitem__
          def __len__(self):
              return 10_000
          def __getitem__(self, i):
              return np.load(f"/data/{i}.npy")

      def loader_kwargs():
          return {"source": Images(), "batch_size": 64, "shuffle": True}

  then:  python -m procpipe.bench --pipeline mytrain.data:loader_kwargs --step-ms 30
  A num_workers / workers in the dict is your own setting: the sweep replaces it with each
  count, and the advice compares it with the recommended one. At 0 workers the options torch
  takes only with workers (persistent_workers, prefetch_factor, multiprocessing_context) are
  left out, and the output says so.
"""


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
        epilog=FACTORY_HELP + f"\nEvery column, the advice and the JSON fields: {DOCS}#what-it-prints; your own "
        f"pipeline: {DOCS}#your-own-pipeline.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--pipeline",
        metavar="MODULE:FACTORY",
        help="your pipeline: FACTORY() returns Loader keyword arguments (dict) or a Loader "
        "(then it must take workers=); the module is imported from the current directory too",
    )
    src.add_argument(
        "--workloads",
        metavar="NAMES",
        help=f"built-in workloads, comma-separated (default: all): {', '.join(WORKLOADS)}, tiny",
    )
    p.add_argument(
        "--workers",
        type=_parse_workers,
        metavar="N,N,...",
        help="worker counts to try (default: 0, 1, 2, ... up to 2x the CPU count)",
    )
    p.add_argument("--size", type=int, metavar="SAMPLES", help="samples per built-in workload (default: a quick size)")
    p.add_argument("--full", action="store_true", help="built-in workloads at their full size (slower)")
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="time the training loop spends per batch (default 0: measure the pipeline alone)",
    )
    p.add_argument(
        "--step-mode",
        choices=("sleep", "busy"),
        default="sleep",
        help="how the step is spent: sleep (a GPU step; default) or busy-wait (a CPU step)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=60.0,
        metavar="S",
        help="about how long the whole run takes, shared out between the measurements (default 60)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        metavar="S",
        help="measure one worker count for S seconds, across epochs (default: from --budget)",
    )
    p.add_argument(
        "--batches",
        type=int,
        metavar="N",
        help="measure one worker count for N batches, across epochs (and at most --seconds if given)",
    )
    p.add_argument(
        "--table", action="store_true", help="print each workload's full table and the reasoning behind the advice"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        metavar="N",
        help="measure each worker count N times, in turn, and report the median and spread (default 3)",
    )
    p.add_argument(
        "--within",
        type=float,
        default=0.95,
        metavar="F",
        help="recommend the fewest workers within this fraction of the best throughput (default 0.95)",
    )
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="chart throughput and wait %% against workers (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is shown on a terminal only)")
    p.add_argument(
        "--traceback",
        action="store_true",
        help="when your pipeline fails, show its whole traceback (default: its message)",
    )
    return p


LEGEND = (
    "  (median of the repeats; spread: ± half the range of samples/s; runq %: time the workers waited "
    "for a CPU, held by other processes (! = contended: the bench's own processes left CPUs unused) or, "
    "when the workers and the training process need more than the CPUs, by each other; MB/s: the arrays "
    "and tensors received; USS: private memory, the shared ring left out)"
)


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
    pipeline: PipelineMaker | None = None
    if args.pipeline:
        pipeline = loader_maker(load_factory(args.pipeline))
        jobs: list[tuple[str, Callable[[int], Any], str]] = [(args.pipeline, pipeline, f"pipeline {args.pipeline}")]
    else:
        try:
            names = resolve(args.workloads)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        jobs = [(n, *_builtin_maker(n, args.size, args.full)) for n in names]

    from tqdm import tqdm

    repeats = max(1, args.repeat)
    bar = tqdm(
        total=len(jobs) * len(counts) * repeats,
        unit="setting",
        disable=True if args.no_progress else None,
        leave=False,
        dynamic_ncols=True,
    )
    out = tqdm.write
    cpus = sweep.cpu_count()
    seconds = args.seconds
    if seconds is None and args.batches is None:  # the budget shared out (60 % measuring; the rest starts loaders)
        seconds = max(0.25, 0.6 * args.budget / (len(jobs) * len(counts) * repeats))
    out(
        f"procpipe bench: {cpus} CPUs, workers {','.join(map(str, counts))}"
        + (f", training step {args.step_ms:g} ms ({args.step_mode})" if step_s else ", no training step")
        + (f", {seconds:.2g} s per measurement" if seconds else "")
        + f", {repeats} repeats"
    )
    runs = []
    try:
        for name, make, description in jobs:
            measured: dict[int, list[sweep.Setting]] = {w: [] for w in counts}
            described = ""
            for rep in range(repeats):
                # the counts in turn, starting one further each round: a passing load hits them alike
                for workers in counts[rep % len(counts) :] + counts[: rep % len(counts)]:
                    done = [0]

                    def progress(n: int, name: str = name, workers: int = workers, done: list = done) -> None:
                        done[0] += n
                        bar.set_postfix_str(f"{name}, {workers} workers, {done[0]} batches", refresh=False)
                        bar.update(0)  # redraws at most every bar.mininterval

                    progress(0)
                    try:
                        setting = sweep.measure(
                            make,
                            workers,
                            step_s=step_s,
                            step_mode=args.step_mode,
                            max_batches=args.batches,
                            max_seconds=seconds,
                            progress=None if bar.disable else progress,
                        )
                    except Exception as exc:
                        if pipeline is None or args.traceback:
                            raise
                        raise SystemExit(failed(name, workers, exc)) from None
                    measured[workers].append(setting)
                    bar.update(1)
                    if pipeline is not None and not described:  # (known once the factory has run)
                        described = f"{pipeline.front}({pipeline.arguments})"
                        out(f"measuring {name}: {described}, {pipeline.option} swept")
            settings = [sweep.combine(measured[w]) for w in counts]
            rec = sweep.recommend(settings, within=args.within, step_s=step_s, cpus=cpus)
            out(f"{name:>12}: {rec['text']}")
            if pipeline is not None:
                for note in pipeline.notes:
                    out(f"  note: {note}")
                out(f"  what to do: {pipeline.advice(rec['workers'], settings)}.")
            if args.table:
                out(
                    f"\n== {name}: {described or description}\n{sweep.format_table(settings)}\n{LEGEND}\n"
                    f"{rec['text']}.\n  why: {rec['why']}.\n"
                )
            runs.append(
                {
                    "name": name,
                    "description": described or description,
                    "settings": [s.to_json() for s in settings],
                    "recommendation": rec,
                }
            )
    finally:
        bar.close()
    if not args.table:
        print(
            "(--table: each setting's measurements, and why)"
            if pipeline
            else "(--table: each workload's measurements, and why)"
        )
    if pipeline is None:
        print(OWN_PIPELINE)
    if args.json:
        from procpipe import __version__

        document = {
            "procpipe_version": __version__,
            "python": platform.python_version(),
            "cpu_count": cpus,
            "argv": sys.argv[1:] if argv is None else list(argv),
            "workers": counts,
            "step_ms": args.step_ms,
            "step_mode": args.step_mode,
            "within": args.within,
            "repeat": repeats,
            "runs": runs,
        }
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        from .plot import plot

        plot(runs, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
