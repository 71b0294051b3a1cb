"""The worker's hot loop alone, two versions side by side: ``produce`` of one batch, in-process.

``bench/ab.py`` times whole epochs (workers, pipes, the ring), where a few hundred
nanoseconds per sample drown in the noise of a busy machine. This times only what a worker
runs per task, ``procpipe._worker.produce.produce`` of a batch of indices (the per-sample
stages, then collation into a buffer), in one process per tree, alternating the trees
(A B, then B A, ...), and prints the median microseconds per batch and the ratio B / A.
Each process reports its best of 9 passes in CPU time (``process_time``), so a machine busy
with other work slows the figures less than wall-clock time would.

    python bench/produce_ab.py --base main            # the working tree (B) against a commit (A)
    python bench/produce_ab.py --a /path/old --reps 9

Workloads: ``tiny64`` (64 Python ints, no fn: the loop's own cost), ``fnonly64`` (64 small
arrays through an ``fn``, the only stage: ``stages.fn_only``'s loop), ``fn64`` (the same through
an ``fn`` and an ``augment``: ``run_sample`` per sample), ``skip64`` (that with ``on_error="skip"``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import sys, time, numpy as np
from procpipe._worker.produce import produce
from procpipe._core.rng import SampleScope
name = sys.argv[1]
source = list(range(4096)) if name == "tiny64" else [np.full(16, i, np.float32) for i in range(4096)]
fn = None if name == "tiny64" else (lambda x: x * 2)
augment = None if name in ("tiny64", "fnonly64") else (lambda x: x + 1)
try:
    from procpipe._worker.worker_spec import WorkerSpec
    from procpipe._worker.index_producer import IndexProducer
    producer = {"producer": IndexProducer(source)}
except ImportError:  # an older tree: WorkerSpec in process.py, an indexed reader by default
    from procpipe._worker.process import WorkerSpec
    producer = {}
spec = WorkerSpec(source=source, fn=fn, collate_fn=None, batched=True, seed=0, skip=name == "skip64",
                  augment=augment, seed_globals=None, **producer)
scope = SampleScope(0, seed_globals=None)
buffer = bytearray(1 << 20)
batches = [list(range(i, i + 64)) for i in range(0, 4096, 64)]
for b in batches[:8]:
    produce(spec, scope, 0, b, memoryview(buffer), len(buffer))
best = []
for _ in range(9):
    t = time.process_time()  # CPU time: a process waiting for a core on a busy machine is not counted
    for b in batches:
        produce(spec, scope, 0, b, memoryview(buffer), len(buffer))
    best.append((time.process_time() - t) / len(batches))
print(min(best) * 1e6)
"""


def run(tree: Path, workload: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, workload],
        env={"PYTHONPATH": str(tree), "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def export(revision: str, into: Path) -> Path:
    archive = into / "a.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), revision, "procpipe"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "a", filter="data")
    return into / "a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="git revision for tree A")
    parser.add_argument("--a", help="source tree A (instead of --base)")
    parser.add_argument("--b", default=str(REPO), help="source tree B (default: this working tree)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tree_a = Path(args.a) if args.a else export(args.base, Path(tmp))
        trees = {"A": tree_a, "B": Path(args.b)}
        print(f"A = {args.a or args.base}\nB = {args.b}\n\nworkload     A us/batch   B us/batch    B/A")
        for workload in ("tiny64", "fnonly64", "fn64", "skip64"):
            times: dict[str, list[float]] = {"A": [], "B": []}
            for rep in range(args.reps):
                for name in "AB" if rep % 2 == 0 else "BA":
                    times[name].append(run(trees[name], workload))
            a, b = statistics.median(times["A"]), statistics.median(times["B"])
            print(f"{workload:<10} {a:12.1f} {b:12.1f} {b / a:7.3f}")


if __name__ == "__main__":
    main()
