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
- ``procpipe->tf``: ``procpipe.tf.dataset(Loader(..., stage_slots=procpipe.tf.VIEWS))``.

Workloads: ``tf_cpu``: a dict record (``image`` 32x32x3 uint8 randomly flipped, ``label``,
``id`` str) after about 2 ms of pure Python; ``tf_transfer``: the ``transfer`` workload's
224x224x3 uint8 image, no compute. Needs TensorFlow and Keras (TensorFlow backend).
"""
from __future__ import annotations

import math
import os
import random
import time
from typing import Any

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from procpipe import Loader  # noqa: E402
from procpipe.bench.workloads import CPU_ITERS, IMAGE_SHAPE, TransferDataset  # noqa: E402

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
        return {k: (np.array([s[k] for s in samples]) if isinstance(first[k], str)
                    else np.stack([s[k] for s in samples])) for k in first}
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
        outs = [tf.ensure_shape(o, s.shape) for o, s in zip(outs, flat)]  # py_function loses the shapes
        return dict(zip(keys, outs)) if keys else outs[0]

    ds = tf.data.Dataset.from_generator(lambda: iter(range(len(source))), output_signature=tf.TensorSpec((), tf.int64))
    return ds.map(parallel, num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size).prefetch(tf.data.AUTOTUNE)


def generator_dataset(source: Any, batch_size: int) -> Any:
    """The sequential recipe: the preprocessing inside from_generator."""
    import tensorflow as tf

    ds = tf.data.Dataset.from_generator(lambda: (source[i] for i in range(len(source))),
                                        output_signature=_spec(source[0], tf))
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


def pydataset_iterator(source: Any, batch_size: int, workers: int) -> Any:
    """PyDataset(workers, use_multiprocessing=True) as Keras' TensorFlow backend iterates it."""
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    adapter = PyDatasetAdapter(_pydataset_class()(source, batch_size, workers), shuffle=False)
    adapter.on_epoch_begin()
    try:
        yield from adapter.get_tf_dataset()
    finally:
        adapter.on_epoch_end()


def procpipe_tf_iterator(source: Any, batch_size: int, workers: int, prefetch: int) -> Any:
    """procpipe into TensorFlow: ``procpipe.tf.dataset`` over a loader with the recommended spare slots."""
    import procpipe.tf

    with Loader(source, batch_size=batch_size, workers=workers, prefetch=prefetch, start_method="forkserver",
                stage_slots=procpipe.tf.VIEWS) as loader:
        yield from procpipe.tf.dataset(loader)


def workload(name: str, size: int) -> tuple[Any, int, str, int, str]:
    """``(source, batch_size, unit, sample_bytes, description)`` of ``tf_cpu`` or ``tf_transfer``."""
    if name == "tf_cpu":
        return (DictRecords(size), 32, "samples/s", 0,
                "dict record (32x32x3 image randomly flipped, label, str id) after ~2 ms of pure Python")
    return (TransferDataset(size), 64, "GB/s", int(np.prod(IMAGE_SHAPE)),
            "copy of a preloaded 224x224x3 uint8 image into TensorFlow, batch 64 = 9.6 MB")


def engines(source: Any, batch_size: int, workers: int, prefetch: int) -> dict[str, Any]:
    """Engine name -> a function making the iterable that one timed epoch consumes."""
    return {"procpipe->tf": lambda: procpipe_tf_iterator(source, batch_size, workers, prefetch),
            "tf py_function": lambda: py_function_dataset(source, batch_size),
            "tf from_generator": lambda: generator_dataset(source, batch_size),
            "PyDataset mp": lambda: pydataset_iterator(source, batch_size, workers)}


def consume(make: Any, consume_epoch: Any, n: int, batch_size: int, warmup: int) -> Any:
    """Time one epoch of ``make()`` with compare.py's ``_consume``, then close its iterator."""
    t0 = time.perf_counter()
    it = iter(make())
    try:
        return consume_epoch(it, t0, n, batch_size, warmup)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


#: Goal rows per workload: (reference engine, ratio procpipe->tf must reach, note).
GOALS = {
    "tf_cpu": [("tf py_function", 2.5, "the issue's goal at 2 workers"), ("tf from_generator", 1.0, ""),
               ("PyDataset mp", 1.0, "Keras' own worker processes"), ("procpipe", 0.9, "the bridge's cost")],
    "tf_transfer": [("tf py_function", 10.0, "the issue's goal at 2 workers"), ("tf from_generator", 1.0, ""),
                    ("PyDataset mp", 1.0, ""), ("procpipe", 0.9, "the bridge's cost (numpy batches vs tensors)")],
}
