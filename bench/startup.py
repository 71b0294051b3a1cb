"""Time to the first batch in the processes users really run, beside torch's DataLoader.

Each measurement is a fresh Python process (a script as a user writes one: numpy-only
map-style dataset, 256 samples of 3x64x64 float32, batches of 32, 2 workers), timing
from creating the loader to its first batch (the libraries are imported before, at the top
of the script). The cases:

- ``first``: the first loader of a script that imported torch;
- ``second``: a second loader (a validation loader) created while the first iterates
  (each kind against its own kind: DataLoader beside DataLoader);
- ``thread``: a script with torch imported and one thread of its own running (a metrics
  or logging thread), started before the loader (after ``import procpipe``: "auto" forks
  the workers from the zygote, procpipe._worker.zygote);
- ``notebook``: as a Jupyter kernel runs a notebook's first loader: threads of its own run
  before the first cell, so before ``import procpipe`` (no zygote: "auto" starts the
  workers from a forkserver, once per process), torch imported; the goal is 0.5 s;
- ``tf``: a script that imported TensorFlow and ran a few ops, then imported procpipe
  (numpy-only ``fn``), beside tf.data's recipe for Python code (``from_generator``). Runs
  only where ``--tf-python`` (default: this interpreter) can import tensorflow.

Kinds: ``torch`` (``torch.utils.data.DataLoader``, fork), ``procpipe`` (``procpipe.Loader``,
defaults), ``facade`` (``procpipe.torch.DataLoader``, defaults), ``tf.data`` (tf case only).
Within each repetition the runs are alternated (a rotating order), so a noisy machine hits
them alike. Prints every run, then per case and kind the median, min, max, the start
method "auto" chose, and the median's ratio to the case's baseline (DataLoader; tf.data
for the tf case), with the goal.

    python bench/startup.py                      # 3 repetitions
    python bench/startup.py --reps 5 --cases first,second --tf-python /path/to/venv/bin/python
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

from script_run import run_script

SCRIPT = textwrap.dedent('''
    import json, sys, threading, time, warnings
    warnings.simplefilter("ignore")
    case, kind, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if case == "notebook":  # a kernel's threads (heartbeat, IOPub, control) run before any cell
        kernel = threading.Event()
        for name in ("Heartbeat", "IOPub", "Control"):
            threading.Thread(target=kernel.wait, name=name, daemon=True).start()
    if case == "tf":
        import os
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf
        x = tf.random.uniform((64, 64))
        float(tf.reduce_sum(tf.matmul(x, x)))  # a few ops: TensorFlow's thread pools run
    else:
        import torch
    import numpy as np
    if kind == "procpipe":  # imported at the top of the script, as a user does (after TensorFlow, in the tf case)
        from procpipe import Loader
    elif kind == "facade":
        from procpipe.torch import DataLoader as Facade

    class Images:
        """A small image-like map-style dataset: 256 samples of 3x64x64 float32 (numpy only)."""
        def __len__(self):
            return 256
        def __getitem__(self, i):
            rng = np.random.default_rng(i)
            return rng.standard_normal((3, 64, 64), dtype=np.float32), np.int64(i % 10)

    def make():
        if kind == "torch":
            from torch.utils.data import DataLoader
            return DataLoader(Images(), batch_size=32, num_workers=workers)
        if kind == "facade":
            return Facade(Images(), batch_size=32, num_workers=workers)
        if kind == "tf.data":
            ds = Images()
            def gen():
                for i in range(len(ds)):
                    yield ds[i]
            sig = (tf.TensorSpec((3, 64, 64), tf.float32), tf.TensorSpec((), tf.int64))
            return tf.data.Dataset.from_generator(gen, output_signature=sig).batch(32).prefetch(2)
        return Loader(Images(), batch_size=32, workers=workers)

    def method(loader):
        return getattr(loader, "start_method", "fork" if kind == "torch" else "-")

    keep = []
    if case == "second":
        train = make()  # the training loader, iterating
        train_it = iter(train)
        next(train_it)
        keep.append((train, train_it))
    elif case == "thread":
        stop = threading.Event()
        def metrics():
            while not stop.wait(0.05):
                pass
        threading.Thread(target=metrics, name="metrics", daemon=True).start()
    start = time.perf_counter()
    loader = make()
    it = iter(loader)
    first = next(it)
    t_first = time.perf_counter() - start
    used = method(loader)
    del it
    for l in [loader] + [k[0] for k in keep]:
        close = getattr(l, "close", None)
        if close is not None:
            close()
    print(json.dumps({"first": t_first, "method": used}))
''')

CASES = {  # case: (kinds, baseline kind, goal as a ratio to the baseline, or seconds)
    "first": (("torch", "procpipe", "facade"), "torch", "<= 1.5x"),
    "second": (("torch", "procpipe", "facade"), "torch", "<= 1.5x"),
    "thread": (("torch", "procpipe", "facade"), "torch", "<= 2x"),
    "notebook": (("torch", "procpipe", "facade"), "torch", "<= 0.5 s"),
    "tf": (("tf.data", "procpipe"), "tf.data", "<= 1 s"),
}


def has_tensorflow(python: str) -> bool:
    out = subprocess.run(
        [python, "-c", "import tensorflow"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        check=False,  # a failing import is the answer "no"
    )
    return out.returncode == 0


def run_once(python: str, path: str, case: str, kind: str, workers: int) -> dict:
    return run_script(python, path, [case, kind, str(workers)], timeout=600, what=f"{case}/{kind}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument(
        "--tf-python",
        default=sys.executable,
        help="the interpreter for the tf case (one with tensorflow, numpy, dill, multiprocess, psutil)",
    )
    opts = p.parse_args(argv)
    cases = opts.cases.split(",")
    if "tf" in cases and not has_tensorflow(opts.tf_python):
        print(f"tf case skipped: {opts.tf_python} cannot import tensorflow (see --tf-python)")
        cases.remove("tf")
    runs = [(case, kind) for case in cases for kind in CASES[case][0]]
    results: dict[tuple[str, str], list[dict]] = {r: [] for r in runs}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.py")
        with open(path, "w") as f:
            f.write(SCRIPT)
        for rep in range(opts.reps):
            order = runs[rep % len(runs) :] + runs[: rep % len(runs)]
            for case, kind in order:
                python = opts.tf_python if case == "tf" else sys.executable
                r = run_once(python, path, case, kind, opts.workers)
                results[(case, kind)].append(r)
                print(f"rep {rep}  {case:7s} {kind:9s} first batch {r['first']:.3f} s  ({r['method']})", flush=True)
    print(f"\nworkers={opts.workers}, {opts.reps} fresh processes per row; first batch in seconds")
    print(f"{'case':7s} {'kind':9s} {'median':>8s} {'min':>7s} {'max':>7s} {'method':>11s} {'ratio':>7s}  goal")
    for case in cases:
        kinds, base_kind, goal = CASES[case]
        base = statistics.median(r["first"] for r in results[(case, base_kind)])
        for kind in kinds:
            firsts = [r["first"] for r in results[(case, kind)]]
            median = statistics.median(firsts)
            methods = "/".join(sorted({r["method"] for r in results[(case, kind)]}))
            shown = goal if kind != base_kind else "(baseline)"
            print(
                f"{case:7s} {kind:9s} {median:8.3f} {min(firsts):7.3f} {max(firsts):7.3f} {methods:>11s} "
                f"{median / base:6.2f}x  {shown}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
