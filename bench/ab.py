"""Two versions of procpipe side by side: is a change slower than the code it replaces?

On a noisy machine only ratios measured in one run mean anything, so this runs the same
engine-cost workloads under two source trees, alternating the trees within each
repetition (A B, then B A, ...), each epoch in a fresh interpreter whose ``PYTHONPATH``
starts with that tree (the workers import procpipe from there too). It prints, per
workload, the median time per batch of each tree over the repetitions, their spread, and
the ratio B / A (above 1.0: B is slower).

    python bench/ab.py --base HEAD~3             # the working tree (B) against a commit (A)
    python bench/ab.py --a /path/old --b /path/new --reps 7 --workloads tiny1,stream
    python bench/ab.py --base 085bc36 --b-options '{"seed_globals": false}'   # B's Loader gets these too

Workloads (only the public API, so any version runs them):

========= ===================================================================
tiny1     ``Loader(range(n), batch_size=1, workers=2)``: the per-batch cost
tiny64    the same with ``batch_size=64``
stream    ``Shards`` of tiny int records, ``batch_size=64``, ``workers=2``
transfer  224x224x3 uint8 copies, batch 64 (9.6 MB per batch), ``workers=2``
cpu       a pure-Python loop holding the GIL (about 2 ms) and 256 float32, batch 20, ``workers=2``
========= ===================================================================

The figure is the steady state: seconds per batch from the 50th batch to the end of the
epoch (start-up excluded), so it measures what each batch costs the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = ("tiny1", "tiny64", "stream", "transfer", "cpu")
WARMUP_BATCHES = 50


def _epoch(name: str, options: str = "{}") -> float:
    """Run one epoch of ``name`` with the procpipe first on sys.path; seconds per batch.
    ``options``: JSON of extra ``Loader`` keyword arguments (for options only one tree has)."""
    import numpy as np

    import procpipe

    extra = {"workers": 2, **json.loads(options)}  # (options may replace workers, e.g. workers=0)

    if name == "tiny1":
        loader = procpipe.Loader(range(6_000), batch_size=1, **extra)
    elif name == "tiny64":
        loader = procpipe.Loader(range(64 * 3_000), batch_size=64, **extra)
    elif name == "stream":
        loader = procpipe.Loader(procpipe.Shards(list(range(8)), _read_ints, cycle_length=4), batch_size=64, **extra)
    elif name == "transfer":
        image = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
        loader = procpipe.Loader(range(64 * 150), lambda i: image.copy(), batch_size=64, **extra)
    elif name == "cpu":  # (the reference workload's sample, written here: any version runs it)
        loader = procpipe.Loader(range(20 * 120), _burn, batch_size=20, **extra)
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    with loader:
        count, started = 0, 0.0
        for batch in loader:
            count += 1
            if count == WARMUP_BATCHES:
                started = time.perf_counter()
            del batch
        return (time.perf_counter() - started) / (count - WARMUP_BATCHES)


def _burn(i: int):
    """The ``cpu`` workload's sample: pure Python holding the GIL for about 2 ms, then 256 float32."""
    import numpy as np

    x = i
    for k in range(40_000):
        x = (x * 31 + k) & 0xFFFFFF
    return np.full(256, x & 0xFF, np.float32), i % 10


def _read_ints(shard: int):
    """open_fn of the ``stream`` workload: 20,000 ints per shard."""
    return iter(range(shard * 1_000_000, shard * 1_000_000 + 20_000))


def _export(rev: str) -> str:
    """A temporary copy of the repository's tree at ``rev`` (``git archive``)."""
    out = tempfile.mkdtemp(prefix="procpipe-ab-")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(out, filter="data")
    return out


def _one(tree: str, name: str, options: str) -> float:
    """One epoch in a fresh interpreter importing procpipe from ``tree``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
    code = "import sys; sys.path.insert(0, sys.argv[1]); import ab; print(ab._epoch(sys.argv[2], sys.argv[3]))"
    result = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), name, options],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,  # the failure is raised below, with the child's stderr
    )
    if result.returncode != 0:
        raise RuntimeError(f"{name} under {tree} failed:\n{result.stderr[-2000:]}")
    return float(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="git revision for tree A (exported to a temporary folder)")
    parser.add_argument("--a", help="source tree A (instead of --base)")
    parser.add_argument("--b", default=str(REPO), help="source tree B (default: this working tree)")
    parser.add_argument("--a-options", default="{}", help="JSON: extra Loader arguments for tree A")
    parser.add_argument("--b-options", default="{}", help="JSON: extra Loader arguments for tree B")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--json", help="write the raw times here")
    args = parser.parse_args(argv)
    if bool(args.base) == bool(args.a):
        parser.error("give exactly one of --base REV and --a TREE")
    tree_a = args.a or _export(args.base)
    try:
        _compare(args, tree_a)
    finally:
        if not args.a:
            shutil.rmtree(tree_a, ignore_errors=True)


def _compare(args: argparse.Namespace, tree_a: str) -> None:
    """Alternate the trees over ``args.reps`` repetitions and print the table."""
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    times: dict[str, dict[str, list[float]]] = {n: {"A": [], "B": []} for n in names}
    for rep in range(args.reps):
        a, b = ("A", tree_a, args.a_options), ("B", args.b, args.b_options)
        for name in names:
            for label, tree, options in (a, b) if rep % 2 == 0 else (b, a):
                times[name][label].append(_one(tree, name, options))
        print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr)
    print(f"A = {args.base or tree_a} {args.a_options}\nB = {args.b} {args.b_options}\n")
    print(f"{'workload':<10} {'A us/batch':>12} {'B us/batch':>12} {'B/A':>6}   spread A / B")
    for name in names:
        a, b = times[name]["A"], times[name]["B"]
        ma, mb = statistics.median(a), statistics.median(b)
        spread = lambda xs, m: (max(xs) - min(xs)) / 2 / m * 100  # noqa: E731
        print(
            f"{name:<10} {ma * 1e6:12.1f} {mb * 1e6:12.1f} {mb / ma:6.3f}   "
            f"±{spread(a, ma):.0f}% / ±{spread(b, mb):.0f}%"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
