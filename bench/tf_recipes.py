"""The TensorFlow recipes beside procpipe, for ``bench/compare.py --workloads tf``.

What users write instead of procpipe when their records are dicts and their preprocessing
is arbitrary Python, each timed on the same workloads as procpipe into TensorFlow
(``procpipe.tf.dataset``) and procpipe alone (numpy batches):

- ``tf py_function``: ``from_generator`` (the record indices) + ``map(tf.py_function(...),
  num_parallel_calls=AUTOTUNE)`` + the ``ensure_shape`` fix-up (py_function loses the
  shapes) + ``batch`` + ``prefetch(AUTOTUNE)``: tf.data's threads, which hold the GIL;
- ``tf from_generator``: the preprocessing inside the generator, sequential;
- ``PyDataset mp``: ``keras.utils.PyDataset(workers=N, use_multiprocessing=True)`` as Keras'
  TensorFlow backend feeds it (``get_tf_dataset()`` of its data adapter);
- ``procpipe->tf``: ``procpipe.tf.dataset(Loader(...))``, the loader made with defaults.

Workloads: ``tf_cpu``: a dict record (``image`` 32x32x3 uint8 randomly flipped, ``label``,
``id`` str) after about 2 ms of pure Python; ``tf_transfer``: the ``transfer`` workload's
224x224x3 uint8 image, no compute. Needs TensorFlow, Keras (TensorFlow backend) and psutil.

Every engine is built once, before the timed passes (:func:`engines`), and each repetition
is one more epoch over it, as a training loop runs them; compare.py times each pass the same
way (throughput after the first batch and the same warm-up for all). Beside throughput,
:func:`consume` records the CPU time per sample of the whole process tree in the timed
window (``CPU_MS``): what the bridge costs shows there even on a machine busy with other
work, where throughput alone is too noisy to show a few percent.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from procpipe import Loader
from procpipe.bench.workloads import CPU_ITERS, IMAGE_SHAPE, TransferDataset

IMAGE = (32, 32, 3)


class DictRecords:
    """``tf_cpu``: a dict per index after about 2 ms of pure Python; the image flipped at random."""

    def __init__(self, n: int, iters: int = CPU_ITERS) -> None:
        self.n = n
        self.iters = iters

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        x = i
        for k in range(self.iters):  # the cpu workload's loop: pure Python, holding the GIL
            x = (x * 31 + k) & 0xFFFFFF
        image = np.full(IMAGE, x & 0xFF, np.uint8)
        image[0, 0, 0] = 0
        if random.random() < 0.5:  # procpipe seeds it per sample; tf.data and Keras leave it global
            image = np.ascontiguousarray(image[:, ::-1])
        return {"image": image, "label": np.int64(i % 10), "id": f"rec-{i}"}


def collate(samples: list) -> Any:
    """Stack samples (dicts of arrays and str, or arrays) into a batch, as procpipe's default does."""
    first = samples[0]
    if isinstance(first, dict):
        return {
            k: (np.array([s[k] for s in samples]) if isinstance(first[k], str) else np.stack([s[k] for s in samples]))
            for k in first
        }
    return np.stack(samples)


def _spec(sample: Any, tf: Any) -> Any:
    def leaf(v: Any) -> Any:
        return tf.TensorSpec((), tf.string) if isinstance(v, str) else tf.TensorSpec(np.shape(v), np.asarray(v).dtype)

    return {k: leaf(v) for k, v in sample.items()} if isinstance(sample, dict) else leaf(sample)


def py_function_dataset(source: Any, batch_size: int) -> Any:
    """tf.data's recipe: from_generator + map(py_function, AUTOTUNE) + ensure_shape + batch + prefetch."""
    import tensorflow as tf

    spec = _spec(source[0], tf)
    keys = sorted(spec) if isinstance(spec, dict) else None
    flat = [spec[k] for k in keys] if keys else [spec]

    def load(i: Any) -> list:
        sample = source[int(i)]
        return [sample[k] for k in keys] if keys else [sample]

    def parallel(i: Any) -> Any:
        outs = tf.py_function(load, [i], [s.dtype for s in flat])
        outs = [tf.ensure_shape(o, s.shape) for o, s in zip(outs, flat, strict=True)]  # py_function loses the shapes
        return dict(zip(keys, outs, strict=True)) if keys else outs[0]

    ds = tf.data.Dataset.from_generator(lambda: iter(range(len(source))), output_signature=tf.TensorSpec((), tf.int64))
    return ds.map(parallel, num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size).prefetch(tf.data.AUTOTUNE)


def generator_dataset(source: Any, batch_size: int) -> Any:
    """The sequential recipe: the preprocessing inside from_generator."""
    import tensorflow as tf

    ds = tf.data.Dataset.from_generator(
        lambda: (source[i] for i in range(len(source))), output_signature=_spec(source[0], tf)
    )
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def _pydataset_class() -> type:
    import keras

    class Batches(keras.utils.PyDataset):
        """Keras' own parallel loader: batches built in ``workers`` processes."""

        def __init__(self, source: Any, batch_size: int, workers: int) -> None:
            super().__init__(workers=workers, use_multiprocessing=True, max_queue_size=2 * workers + 2)
            self.source, self.batch_size = source, batch_size

        def __len__(self) -> int:
            return math.ceil(len(self.source) / self.batch_size)

        def __getitem__(self, b: int) -> Any:
            stop = min(len(self.source), (b + 1) * self.batch_size)
            batch = collate([self.source[i] for i in range(b * self.batch_size, stop)])
            if isinstance(batch, dict):  # Keras' PyDataset cannot carry a str field ("Invalid dtype: str192")
                batch.pop("id")
            return (batch,)  # (x,): Keras' batch structure

    return Batches


def pydataset_passes(source: Any, batch_size: int, workers: int) -> Callable[[], Iterator[Any]]:
    """PyDataset(workers, use_multiprocessing=True) as Keras' TensorFlow backend iterates it in ``fit``:
    one adapter and one ``get_tf_dataset()``, each epoch between ``on_epoch_begin``/``on_epoch_end``
    (which start and stop Keras' worker pool, as ``fit`` does every epoch)."""
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    adapter = PyDatasetAdapter(_pydataset_class()(source, batch_size, workers), shuffle=False)
    ds = adapter.get_tf_dataset()  # looks at its first batches to infer the signature: once, like fit

    def one_epoch() -> Iterator[Any]:
        adapter.on_epoch_begin()
        try:
            yield from ds
        finally:
            adapter.on_epoch_end()

    return one_epoch


@contextlib.contextmanager
def engines(source: Any, batch_size: int, workers: int, prefetch: int) -> Iterator[dict[str, Callable[[], Any]]]:
    """Engine name -> a function starting one pass (one epoch), every engine built once, here.

    As users run them: the loader, the ``tf.data`` dataset, the ``PyDataset`` adapter are made
    once, outside the timed passes, and each repetition is one more epoch over the same
    object (``model.fit(ds, epochs=...)``). The two procpipe loaders (numpy batches, and into
    TensorFlow through ``procpipe.tf.dataset``, which reserves its spare slots) keep their
    workers between passes; their idle workers sleep while the other engines run.
    """
    import procpipe.tf

    common = {"batch_size": batch_size, "workers": workers, "prefetch": prefetch, "start_method": "forkserver"}
    with Loader(source, **common) as bridged, Loader(source, **common) as direct:
        bridged_ds = procpipe.tf.dataset(bridged)  # infers the element_spec from the first batch: once
        py_function = py_function_dataset(source, batch_size)
        generator = generator_dataset(source, batch_size)
        yield {
            "procpipe->tf": lambda: iter(bridged_ds),
            "tf py_function": lambda: iter(py_function),
            "tf from_generator": lambda: iter(generator),
            "PyDataset mp": pydataset_passes(source, batch_size, workers),
            "procpipe": lambda: iter(direct),
        }
    if CPU_MS:
        print(
            "  CPU ms/sample, this process + its children, medians of the timed windows: "
            + ", ".join(f"{k} {_median(v, 0):.3g} + {_median(v, 1):.3g}" for k, v in CPU_MS.items())
            + " (PyDataset: a lower bound, its pool's processes that end within the window are not counted)",
            file=sys.stderr,
            flush=True,
        )


def workload(name: str, size: int) -> tuple[Any, int, str, int, str]:
    """``(source, batch_size, unit, sample_bytes, description)`` of ``tf_cpu`` or ``tf_transfer``."""
    if name == "tf_cpu":
        return (
            DictRecords(size),
            32,
            "samples/s",
            0,
            "dict record (32x32x3 image randomly flipped, label, str id) after ~2 ms of pure Python",
        )
    return (
        TransferDataset(size),
        64,
        "GB/s",
        int(np.prod(IMAGE_SHAPE)),
        "copy of a preloaded 224x224x3 uint8 image into TensorFlow, batch 64 = 9.6 MB",
    )


def _cpu_seconds(processes: dict[tuple[int, float], Any]) -> dict[tuple[int, float], float]:
    """CPU seconds (user + system) of this process and every live descendant, by (pid, start time)."""
    import psutil

    me = psutil.Process()
    out: dict[tuple[int, float], float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            key = (proc.pid, proc.create_time())
            times = processes.setdefault(key, proc).cpu_times()
        except psutil.Error:  # it ended meanwhile
            continue
        out[key] = times.user + times.system
    return out


#: CPU milliseconds per sample over each timed window, by engine: ``(this process, the processes
#: under it)``: the training loop, TensorFlow's threads and procpipe's coordinator; procpipe's
#: workers, Keras' pool. On a machine busy with other work, throughput is noisy but this much
#: less: on an idle machine with as many cores as workers, throughput is about cores / the sum.
CPU_MS: dict[str, list[tuple[float, float]]] = {}


class _Window:
    """The pass's iterator, counting: CPU seconds of this process tree from the first batch of
    compare.py's timed window (after the first batch and ``warmup`` more) to the end."""

    def __init__(self, it: Iterator[Any], warmup: int) -> None:
        self.it, self.start_at, self.got = it, warmup + 2, 0
        self.procs: dict[tuple[int, float], Any] = {}
        self.start: dict[tuple[int, float], float] | None = None
        self.cpu_s: tuple[float, float] | None = None

    def __iter__(self) -> _Window:
        return self

    def __next__(self) -> Any:
        self.got += 1
        if self.got == self.start_at:
            self.start = _cpu_seconds(self.procs)
        try:
            return next(self.it)
        except StopIteration:
            if self.start is not None and self.cpu_s is None:
                end = _cpu_seconds(self.procs)  # a process that began in the window counts from 0
                spent = {k: v - self.start.get(k, 0.0) for k, v in end.items()}
                mine = sum(v for (pid, _), v in spent.items() if pid == os.getpid())
                self.cpu_s = (mine, sum(spent.values()) - mine)
            raise


def consume(label: str, start_pass: Callable[[], Any], consume_epoch: Any, n: int, batch_size: int, warmup: int) -> Any:
    """Time one pass of ``start_pass()`` with compare.py's ``_consume`` (recording its CPU per
    sample in ``CPU_MS[label]``), then close the pass's iterator."""
    t0 = time.perf_counter()
    it = iter(start_pass())
    window = _Window(it, warmup)
    try:
        m = consume_epoch(window, t0, n, batch_size, warmup)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    if window.cpu_s is not None and m.samples:
        CPU_MS.setdefault(label, []).append((window.cpu_s[0] / m.samples * 1e3, window.cpu_s[1] / m.samples * 1e3))
    return m


#: Goal rows per workload: (reference engine, ratio procpipe->tf must reach, note).
#: The throughput rows; :func:`cpu_rows` adds the CPU-per-sample one.
GOALS = {
    "tf_cpu": [
        ("tf py_function", 2.5, "the issue's goal at 2 workers"),
        ("tf from_generator", 1.0, ""),
        ("PyDataset mp", 1.0, "Keras' own worker processes"),
        ("procpipe", 0.9, "the bridge's cost"),
    ],
    "tf_transfer": [
        ("tf py_function", 10.0, "the issue's goal at 2 workers"),
        ("tf from_generator", 1.0, ""),
        ("PyDataset mp", 1.0, ""),
        # TensorFlow's own time between two elements of from_generator (0.7-0.8 ms, timed in
        # a pass) against procpipe's 1.5 ms per 9.6 MB batch on 2 cores: 0.6, not 0.9
        ("procpipe", 0.6, "the bridge's cost: TensorFlow's ~0.7 ms per element"),
    ],
}


def _median(values: list[tuple[float, float]], i: int) -> float:
    return statistics.median(v[i] for v in values)


def cpu_rows(name: str) -> list[tuple[str, float, float, float, str]]:
    """``(label, procpipe->tf, procpipe, at most, note)``: the bridge's CPU cost per sample, in ms,
    for ``tf_cpu`` (where CPU is what limits procpipe's throughput); empty where not measured.

    The bridge adds work to this process only (the workers run the same ``fn`` either way), so
    the row compares procpipe's whole CPU per sample (``CPU_MS`` medians) with the same plus
    the difference in this process's CPU: the workers' CPU per sample varies by several
    percent from pass to pass on a busy machine, which would hide a cost of 1 or 2 %.
    """
    bridged, direct = CPU_MS.get("procpipe->tf"), CPU_MS.get("procpipe")
    if name != "tf_cpu" or not bridged or not direct:
        return []
    total = _median(direct, 0) + _median(direct, 1)
    added = _median(bridged, 0) - _median(direct, 0)
    return [
        (
            f"{name}: CPU ms/sample with the bridge vs without",
            total + added,
            total,
            1.05,
            f"this process: {_median(bridged, 0):.3g} vs {_median(direct, 0):.3g} ms/sample",
        )
    ]
