"""What TensorFlow itself costs per element, with no loader: the floor under the tf.data bridge.

``procpipe.tf.dataset`` is a ``tf.data.Dataset.from_generator`` whose elements are the loader's
batches. Here the same construction yields preallocated, 64-byte-aligned batches (which
TensorFlow adopts without copying) shaped as ``bench/tf_bridge_ratio.py``'s two workloads, so
what is measured is TensorFlow's own work per element: the generator's ``py_func`` in a
``tf.data`` thread, its checks, and the consumer's ``next``. Beside it, for scale: a
``range().map(numpy_function)`` (one Python call per element, no generator machinery) and a
``range().map()`` with no Python at all (what eager iteration alone costs), each consumed by an
eager ``for`` loop and, for the bridge's construction, inside a ``tf.function`` (as
``model.fit`` consumes it). Each figure is the training process's CPU per element
(``time.process_time``, all threads) and the wall time, medians of ``--reps`` alternated passes::

    python bench/tf_element_cost.py --reps 5

On a machine whose cores the workers fill, this CPU is taken from them: it bounds the bridge's
rate against the loader's own (``for b in loader`` costs about 0.2-0.5 ms of CPU per batch).

That cost depends on how far apart the elements come. A loader delivers a batch every few
milliseconds (``tf_transfer``) to tens of milliseconds (``tf_cpu``), not back to back, and
TensorFlow's path per element then runs cold. ``--gaps`` times the bridge's construction with the
generator waiting that many milliseconds before each element (``time.sleep``: no CPU, the GIL
released, as a loader waiting for its workers), beside a plain Python loop over the same
generator::

    python bench/tf_element_cost.py --reps 5 --gaps 0,1,5,25
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterable, Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf


def aligned(shape: tuple, dtype: type = np.uint8) -> np.ndarray:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start : start + nbytes].view(dtype).reshape(shape)
    out[...] = 1
    return out


WORKLOADS = {  # the batches of bench/tf_bridge_ratio.py
    "gil": lambda: {
        "image": aligned((32, 32, 32, 3)),
        "label": aligned((32,), np.int64),
        "id": aligned((32,), np.int64),
        "name": [f"img_{i}" for i in range(32)],
    },
    "transfer": lambda: {
        "image": aligned((64, 224, 224, 3)),
        "label": aligned((64,), np.int64),
        "id": aligned((64,), np.int64),
    },
}


def spec_of(batch: dict) -> dict:
    return {
        k: tf.TensorSpec((None,), tf.string)
        if isinstance(v, list)
        else tf.TensorSpec((None, *v.shape[1:]), tf.as_dtype(v.dtype))
        for k, v in batch.items()
    }


def batches(batch: dict, n: int, gap: float | None = None) -> Iterator[dict]:
    """``n`` views of ``batch``; with ``gap``, each after ``gap`` ms of ``time.sleep`` (no CPU, the GIL
    released: a loader waiting for its workers)."""
    for _ in range(n):
        if gap is not None:
            time.sleep(gap / 1000)
        yield {k: v[:] for k, v in batch.items()}


def constructions(batch: dict, n: int, gap: float | None = None) -> dict:
    """The ways of making a dataset of ``n`` elements, by name: each value makes a fresh one."""
    spec = spec_of(batch)
    options = tf.data.Options()
    options.autotune.enabled = False  # as procpipe.tf.dataset sets it
    keys = list(batch)

    def from_generator():
        return tf.data.Dataset.from_generator(lambda: batches(batch, n, gap), output_signature=spec).with_options(
            options
        )

    def numpy_map():
        each = batches(batch, n, gap)

        def call(i):
            b = next(each)
            return [np.asarray(b[k], object) if isinstance(b[k], list) else b[k] for k in keys]

        def element(i):
            out = tf.numpy_function(call, [i], [spec[k].dtype for k in keys], stateful=True)
            return dict(zip(keys, out, strict=True))

        return tf.data.Dataset.range(n).map(element).with_options(options)

    def no_python():
        made = {k: tf.zeros((1,), spec[k].dtype) for k in keys}
        return tf.data.Dataset.range(n).map(lambda i: made).with_options(options)

    return {
        "from_generator (the bridge's)": from_generator,
        "range.map(numpy_function)": numpy_map,
        "range.map(no Python)": no_python,
    }


def eager(ds: Iterable) -> int:
    count = 0
    for _ in ds:
        count += 1
    return count


@tf.function
def in_graph(ds: tf.data.Dataset) -> tf.Tensor:
    count = tf.constant(0)
    for _ in ds:
        count += 1
    return count


def paced(batch: dict, gaps: list[float], reps: int, elements: int) -> None:
    """CPU per element, elements ``gap`` ms apart: the bridge's construction and a
    ``range().map(numpy_function)`` pulling from the same generator, both eager, and a plain Python loop."""
    names = ("from_generator (the bridge's)", "range.map(numpy_function)")
    warm = constructions(batch, elements, 0.0)
    for name in names:
        eager(warm[name]())
    for gap in gaps:
        made = constructions(batch, elements, gap)
        runs = {name.split(" ")[0]: made[name] for name in names}
        runs["plain Python for"] = lambda gap=gap: batches(batch, elements, gap)
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(reps):
            for name, make in runs.items():
                cpu_started = time.process_time()
                eager(make())
                cpu[name].append(1000 * (time.process_time() - cpu_started) / elements)
        print(
            f"  {elements} elements {gap:g} ms apart (a pass's start included): "
            + "   ".join(f"{name} CPU {statistics.median(v):.3f}" for name, v in cpu.items())
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--elements", type=int, default=400)
    parser.add_argument(
        "--gaps",
        default="",
        help="comma-separated milliseconds between elements (e.g. 0,1,5,25): the bridge's construction with "
        "elements that far apart, as a loader delivers them",
    )
    parser.add_argument("--paced-elements", type=int, default=200, help="elements per pass with --gaps")
    args = parser.parse_args()
    gaps = [float(g) for g in args.gaps.split(",") if g.strip()]
    for workload, make in WORKLOADS.items():
        batch = make()
        made = constructions(batch, args.elements)
        runs = {f"{name}, eager for": (mk, eager) for name, mk in made.items()}
        runs["from_generator (the bridge's), in a tf.function"] = (made["from_generator (the bridge's)"], in_graph)
        for mk, consume in runs.values():
            consume(mk())  # warm: traces, first allocations
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        wall: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.reps):
            for name, (mk, consume) in runs.items():
                ds = mk()
                started, cpu_started = time.perf_counter(), time.process_time()
                consume(ds)
                wall[name].append(1000 * (time.perf_counter() - started) / args.elements)
                cpu[name].append(1000 * (time.process_time() - cpu_started) / args.elements)
        print(f"workload {workload}: ms per element, medians of {args.reps} alternated passes")
        for name in runs:
            print(f"  {name:55s} CPU {statistics.median(cpu[name]):.3f}   wall {statistics.median(wall[name]):.3f}")
        if gaps:
            paced(batch, gaps, args.reps, args.paced_elements)


if __name__ == "__main__":
    main()
