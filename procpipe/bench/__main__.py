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
import importlib
import inspect
import json
import os
import platform
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

from . import sweep
from .workloads import WORKLOADS, resolve

DOCS = (
    "docs/benchmarks.md"  # the bench's page: what it prints, your own pipeline (tests/test_bench.py checks the anchors)
)
OWN_PIPELINE = (
    "To measure your own pipeline: python -m procpipe.bench --pipeline MODULE:FACTORY, where FACTORY() returns "
    "your Loader's or DataLoader's keyword arguments as a dict (--help: the contract and an example; "
    f"{DOCS}#your-own-pipeline); add --step-ms with your training step's time."
)
# procpipe.torch.DataLoader's options that torch takes only with workers (num_workers > 0)
_NEED_WORKERS = ("persistent_workers", "prefetch_factor", "multiprocessing_context")

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


def _facade() -> Any:
    """``procpipe.torch`` if torch is installed (imported only for a facade pipeline)."""
    try:
        import procpipe.torch as facade
    except ImportError:
        return None
    return facade


def _check_keys(kwargs: Mapping[str, Any], target: Any, what: str) -> None:
    """A clear error for a key ``target`` does not take (with the closest valid ones)."""
    import difflib

    params = inspect.signature(target).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    valid = [name for name in params if name != "self"]
    for key in kwargs:
        if key not in params:
            close = difflib.get_close_matches(str(key), valid, n=2)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            raise SystemExit(
                f"--pipeline factory returned {key!r}, which is not a {what} argument{hint}. "
                f"{what} takes: {', '.join(valid)}. See --help for the factory's contract."
            )


class PipelineMaker:
    """``workers -> loader`` for a ``--pipeline`` factory returning kwargs, a Loader or a
    ``procpipe.torch.DataLoader`` (see ``FACTORY_HELP``); it remembers what the output says about
    them: ``front`` (which loader), ``option`` (its worker-count argument), ``theirs`` (the count
    the factory's dict sets, which the sweep replaces), ``arguments`` (the other settings, in
    short) and ``notes`` (what the bench changed or could not measure, each said once)."""

    def __init__(self, factory: Callable[..., Any]) -> None:
        self.factory = factory
        try:
            params = inspect.signature(factory).parameters
            self.takes_workers = "workers" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            self.takes_workers = False
        self.front = "procpipe.Loader"
        self.option = "workers"
        self.theirs: int | None = None
        self.arguments = ""
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def __call__(self, workers: int) -> Any:
        from procpipe import Loader

        made = self.factory(workers=workers) if self.takes_workers else self.factory()
        is_dict = isinstance(made, Mapping)
        facade = _facade() if (is_dict and "dataset" in made) or not (is_dict or isinstance(made, Loader)) else None
        if isinstance(made, Loader) or (facade is not None and isinstance(made, facade.DataLoader)):
            is_facade = facade is not None and isinstance(made, facade.DataLoader)
            if is_facade:
                self.front, self.option = "procpipe.torch.DataLoader", "num_workers"
            # (the facade, procpipe.torch, is typed Any here: mypy does not follow torch)
            have = cast(Any, made).num_workers if is_facade else made.workers_setting
            if have != workers or not isinstance(have, int):
                made.close()
                what = f"{have} workers" if isinstance(have, int) else f"workers={have!r} (autotuned)"
                raise SystemExit(
                    f"--pipeline factory returned a loader with {what} where {workers} were asked: "
                    "to sweep the worker count it must take a workers= argument and build the loader with "
                    "that many, or return the loader's keyword arguments as a dict instead"
                )
            return made
        if isinstance(made, Mapping):
            kwargs = dict(made)
            if "dataset" in kwargs:  # procpipe.torch.DataLoader's arguments
                if facade is None:
                    raise SystemExit(
                        "--pipeline factory returned DataLoader arguments (a 'dataset' key), "
                        "which need torch: pip install procpipe[torch]"
                    )
                self.front, self.option = "procpipe.torch.DataLoader", "num_workers"
                self._remember(kwargs.pop("num_workers", None), kwargs, "dataset")
                _check_keys(kwargs, facade.DataLoader.__init__, "procpipe.torch.DataLoader")
                if workers == 0:
                    self._leave_out_worker_options(kwargs)
                self._pin_memory_note(kwargs)
                # the sweep goes beyond the CPUs on purpose: torch's warning about it would say so at every count
                warnings.filterwarnings("ignore", message="This DataLoader will create")
                # the workers outlive the measured epoch, so their memory and CPU can be read at its end
                kwargs.setdefault("persistent_workers", workers > 0)
                return facade.DataLoader(**kwargs, num_workers=workers)
            self._remember(kwargs.pop("workers", None), kwargs, "source")
            _check_keys(kwargs, Loader.__init__, "procpipe.Loader")
            return Loader(**kwargs, workers=workers)
        raise SystemExit(
            f"--pipeline factory must return a dict of Loader arguments, a Loader or a "
            f"procpipe.torch.DataLoader, got {type(made).__name__}. See --help."
        )

    def _remember(self, theirs: Any, kwargs: dict[str, Any], source_key: str) -> None:
        if isinstance(theirs, int) and not isinstance(theirs, bool):
            self.theirs = theirs
        shown = [f"{k}={_short(v)}" for k, v in kwargs.items() if k != source_key]
        self.arguments = f"{source_key}={_short(kwargs.get(source_key))}" + "".join(f", {a}" for a in shown)

    def _leave_out_worker_options(self, kwargs: dict[str, Any]) -> None:
        """At 0 workers, the options torch's DataLoader refuses without workers, left out (and said)."""
        left = {k: kwargs.pop(k) for k in _NEED_WORKERS if kwargs.get(k) not in (None, False)}
        if left:
            self.note(
                "at 0 workers (loading in the training process) the bench left out "
                + ", ".join(f"{k}={v!r}" for k, v in left.items())
                + ": torch's DataLoader takes them only with num_workers > 0"
            )

    def _pin_memory_note(self, kwargs: dict[str, Any]) -> None:
        if not kwargs.get("pin_memory"):
            return
        import torch

        if torch.accelerator.is_available():
            self.note("pin_memory=True: pinning is part of what was measured (the facade pins in its stage thread)")
            return
        # torch's DataLoader says this at every iteration; the bench says it once
        warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
        self.note(
            "pin_memory=True: this machine has no accelerator, so nothing is pinned: the figures are the "
            "loading alone; measure on the training machine to include pinning"
        )

    def advice(self, recommended: int, settings: list[sweep.Setting]) -> str:
        """What to do, in the loader's own terms, with the factory's own count compared."""
        text = f"set {self.option}={recommended} in your {self.front}"
        if self.theirs is None:
            return text
        if self.theirs == recommended:
            return f"keep {self.option}={recommended} in your {self.front}: it is the recommended count"
        best = max(s.samples_per_s for s in settings) or 1.0
        theirs = next((s for s in settings if s.workers == self.theirs), None)
        if theirs is None:
            return text + f" (yours, {self.option}={self.theirs}, was not measured: add it to --workers)"
        return text + (
            f" (yours, {self.option}={self.theirs}, gave {100 * theirs.samples_per_s / best:.0f} % of the best "
            f"throughput with {abs(self.theirs - recommended)} {'more' if self.theirs > recommended else 'fewer'} "
            "worker processes)"
        )


def _short(value: Any) -> str:
    """A setting as the output shows it: its repr if short, else its type."""
    text = repr(value)
    return text if len(text) <= 30 else f"<{type(value).__name__}>"


def loader_maker(factory: Callable[..., Any]) -> PipelineMaker:
    """A ``workers -> loader`` function from a ``--pipeline`` factory (``PipelineMaker``)."""
    return PipelineMaker(factory)


LEGEND = (
    "  (median of the repeats; spread: ± half the range of samples/s; runq %: time the workers waited "
    "for a CPU, held by other processes (! = contended) or, when the workers and the training process "
    "need more than the CPUs, by each other; USS: private memory, the shared ring left out)"
)


def _failed(name: str, workers: int, exc: BaseException) -> str:
    """The message of a pipeline that raised while measured: its error, where, and what to do."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return (
        f"procpipe bench: your pipeline {name} failed with {workers} workers: {type(exc).__name__}: {first}\n"
        "  This is the pipeline's own error (its factory, dataset or functions), not the bench's: fix it and "
        "run again (--traceback shows where it was raised)."
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
                        raise SystemExit(_failed(name, workers, exc)) from None
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
        sweep.plot(runs, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
