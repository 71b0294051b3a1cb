"""The tf.data bridge's rate against its own loader's, run after run (issue #34's workload).

Each run is a fresh interpreter: a ``Loader`` made with defaults over 3,072 dict records
(about 2 ms of GIL-bound Python each: an ``id``, a ``name`` str and a 32x32x3 image), batch
32, ``procpipe.tf.dataset(loader)`` (with ``--prefetch``: ``.prefetch(2)`` after it; with
``--fit``: through ``model.fit`` of a one-weight Keras model; ``--workload transfer``: a
224x224x3 uint8 image copy per sample, batch 64, ``--batches`` a pass), one
warm pass, then ``--epochs`` passes of the loader alone and of the bridge, alternated. A
run's ratio is the median bridge rate over the median loader rate; the script prints each
run's and their min and median, and how long each bridge pass waited after its last batch
(TensorFlow's iterator ending: it waited for ``tf.data``'s autotuning thread, up to
seconds), and the training process's CPU time per batch for each (``time.process_time``: all
its threads, TensorFlow's runtime and procpipe's coordinator, not the workers). That CPU is
what the bridge adds: on a machine whose cores the workers fill, it is taken from them, so a
ratio below 1 there is that cost, not a stall. ``--repo`` is the checkout whose ``procpipe`` is
measured (compare two with the same command), e.g.::

    python bench/tf_bridge_ratio.py --runs 10 --workers 2            # this checkout
    python bench/tf_bridge_ratio.py --runs 10 --workers 2 --repo ../main
    python bench/tf_bridge_ratio.py --runs 5 --workers 4 --fit --workload transfer
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

RUN = r"""
import sys, time, statistics, numpy as np, tensorflow as tf, procpipe, procpipe.tf
workers, mode, epochs, workload = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
def load(r):
    acc = 0
    for k in range(20000):
        acc = (acc * 31 + k + r["id"]) % 1000003
    return {"image": np.full((32, 32, 3), acc % 251, np.uint8), "label": np.int64(r["id"] % 10),
            "id": np.int64(r["id"]), "name": r["name"]}
IMAGE = np.random.default_rng(0).integers(0, 255, (224, 224, 3), dtype=np.uint8)
def copy(r):
    return {"image": IMAGE.copy(), "label": np.int64(r["id"] % 10), "id": np.int64(r["id"])}
if workload == "gil":
    records, fn, batch_size = [{"id": i, "name": f"img_{i}"} for i in range(3072)], load, 32
else:
    records, fn, batch_size = [{"id": i} for i in range(64 * int(sys.argv[5]))], copy, 64
with procpipe.Loader(records, fn, batch_size=batch_size, workers=workers) as loader:
    ds = procpipe.tf.dataset(loader)
    if mode == "prefetch":
        ds = ds.prefetch(2)
    model = None
    if mode == "fit":  # a model that costs nothing: what fit's loop adds to the bridge
        import keras
        ds = ds.map(lambda b: (tf.cast(b["label"], tf.float32)[:, None], b["label"]))
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        model.fit(ds, epochs=1, verbose=0)
    else:
        for _ in ds:
            pass
    rates, waits, cpu = {"loader": [], "bridge": []}, [], {"loader": [], "bridge": []}
    for _ in range(epochs):
        for name in ("loader", "bridge"):
            started = last = time.perf_counter()
            cpu_started = time.process_time()
            n = 0
            if name == "bridge" and model is not None:
                model.fit(ds, epochs=1, verbose=0)
                n = len(records)
                last = time.perf_counter()
            else:
                for b in (loader if name == "loader" else ds):
                    n += int(b["id"].shape[0])
                    last = time.perf_counter()
            ended = time.perf_counter()
            rates[name].append(n / (ended - started))
            cpu[name].append(1000 * (time.process_time() - cpu_started) * batch_size / n)
            if name == "bridge":
                waits.append(ended - last)  # after the last batch, until the pass ends
print("RESULT", statistics.median(rates["bridge"]) / statistics.median(rates["loader"]),
      " ".join(f"{v:.0f}" for v in rates["loader"]), "|", " ".join(f"{v:.0f}" for v in rates["bridge"]),
      "| end-of-pass wait (ms):", " ".join(f"{1000 * w:.0f}" for w in waits),
      "| training process CPU ms/batch: loader %.2f bridge %.2f" % (statistics.median(cpu["loader"]),
                                                                   statistics.median(cpu["bridge"])))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4, help="passes of each engine per run (alternated)")
    parser.add_argument("--prefetch", action="store_true", help=".prefetch(2) after the bridge")
    parser.add_argument("--fit", action="store_true", help="the bridge through keras model.fit (a 1-weight model)")
    parser.add_argument(
        "--workload",
        choices=("gil", "transfer"),
        default="gil",
        help="gil: ~2 ms of Python per dict record, batch 32; transfer: a 224x224x3 "
        "uint8 image copy per sample, batch 64 (9.6 MB a batch)",
    )
    parser.add_argument(
        "--batches",
        type=int,
        default=400,
        help="transfer workload: batches per pass (TensorFlow spends about 14 ms starting each pass's "
        "iterator, a quarter of a 40-batch pass of this workload; 400 makes the pass long enough to show the "
        "per-batch cost)",
    )
    parser.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=os.path.abspath(args.repo), TF_CPP_MIN_LOG_LEVEL="3")
    mode = "fit" if args.fit else "prefetch" if args.prefetch else "iterate"
    ratios = []
    for run in range(args.runs):
        out = subprocess.run(
            [sys.executable, "-c", RUN, str(args.workers), mode, str(args.epochs), args.workload, str(args.batches)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=1800,
        ).stdout
        line = next(line for line in out.splitlines() if line.startswith("RESULT"))
        ratio = float(line.split()[1])
        ratios.append(ratio)
        print(f"run {run + 1}: bridge/loader {ratio:.2f}   loader {line.split(' ', 2)[2]}", flush=True)
    print(
        f"workload={args.workload} workers={args.workers} mode={mode} repo={args.repo}: "
        f"min {min(ratios):.2f} median {statistics.median(ratios):.2f} over {len(ratios)} runs"
    )


if __name__ == "__main__":
    main()
