"""A tf.data input pipeline over dict records with Python preprocessing, before and after procpipe.

The question: records are dicts (a file name, a label, a caption), preprocessing is plain
Python with random augmentation, and the model trains with Keras ``fit`` on TensorFlow.

- **Before**: ``from_generator`` over the records + ``map(tf.py_function(...),
  num_parallel_calls=AUTOTUNE)`` + a ``_fixup_shape`` map (``py_function`` loses the shapes)
  + ``batch`` + ``prefetch``. The map's threads hold the GIL: one core's worth of Python.
- **After**: the same ``preprocess`` as a ``procpipe.Loader``'s ``fn`` (worker processes),
  and ``procpipe.tf.dataset(loader)``: a ``tf.data.Dataset`` whose ``element_spec`` is exact
  (the caption a ``tf.string`` vector, every shape known), each pass one loader epoch.

The loader is made before TensorFlow is imported, so its workers are forked without it.

Run: python examples/tf_data_pipeline.py
"""
import os

os.environ["KERAS_BACKEND"] = "tensorflow"  # this example is about TensorFlow
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import random  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import procpipe  # noqa: E402

N, BATCH, EPOCHS, SIZE = 384, 32, 2, 32
RECORDS = [{"file": f"img_{i:05d}.jpg", "label": i % 4, "caption": f"a picture of class {i % 4}"} for i in range(N)]


def preprocess(record):
    """Pure-Python 'decoding' (about 1 ms) and a random flip: the per-record work."""
    seed = sum(ord(c) for c in record["file"])
    x = seed
    for k in range(15_000):
        x = (x * 31 + k) & 0xFFFF
    ys, xs = np.mgrid[0:SIZE, 0:SIZE]
    image = ((xs * (record["label"] + 1) + ys + x) % 256).astype(np.uint8)[..., None].repeat(3, axis=2)
    if random.random() < 0.5:  # procpipe seeds it per sample: reproducible with any worker count
        image = image[:, ::-1]
    return {"image": np.ascontiguousarray(image), "label": np.int64(record["label"]), "caption": record["caption"]}


def make_model(keras):
    model = keras.Sequential([
        keras.Input((SIZE, SIZE, 3)), keras.layers.Rescaling(1 / 255), keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4),
    ])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def before(tf):
    """The usual recipe: from_generator + map(py_function, AUTOTUNE) + _fixup_shape + batch + prefetch."""
    def load(i):
        sample = preprocess(RECORDS[int(i)])
        return sample["image"], sample["label"], sample["caption"]

    def parse(i):
        image, label, caption = tf.py_function(load, [i], [tf.uint8, tf.int64, tf.string])
        return {"image": image, "label": label, "caption": caption}

    def _fixup_shape(sample):  # what everyone copies: py_function's outputs have no shape
        sample["image"].set_shape((SIZE, SIZE, 3))
        sample["label"].set_shape(())
        sample["caption"].set_shape(())
        return sample

    ds = tf.data.Dataset.from_generator(lambda: iter(range(N)), output_signature=tf.TensorSpec((), tf.int64))
    ds = ds.shuffle(N).map(parse, num_parallel_calls=tf.data.AUTOTUNE).map(_fixup_shape)
    return ds.batch(BATCH).prefetch(tf.data.AUTOTUNE)


def to_xy(batch):
    return batch["image"], batch["label"]  # the caption travels along; this model does not use it


class Timer:
    def __init__(self, keras):
        class EpochTimes(keras.callbacks.Callback):
            def on_epoch_begin(cb, epoch, logs=None):
                cb.t = time.perf_counter()

            def on_epoch_end(cb, epoch, logs=None):
                self.times.append(time.perf_counter() - cb.t)

        self.times = []
        self.callback = EpochTimes()


if __name__ == "__main__":
    # After (built first: its workers fork before TensorFlow starts its threads)
    # (no stage_slots: procpipe.tf.dataset reserves the ring slots TensorFlow holds)
    loader = procpipe.Loader(RECORDS, preprocess, batch_size=BATCH, workers=2, shuffle=True)

    import keras  # noqa: E402
    import tensorflow as tf  # noqa: E402

    import procpipe.tf  # noqa: E402

    keras.utils.set_random_seed(0)
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__} ({keras.backend.backend()} backend), "
          f"{N} dict records, batch {BATCH}")

    old = before(tf)
    print("before: element_spec", {k: (tuple(v.shape), v.dtype.name) for k, v in old.element_spec.items()})
    timer = Timer(keras)
    make_model(keras).fit(old.map(to_xy), epochs=EPOCHS, verbose=0, shuffle=False, callbacks=[timer.callback])
    old_rate = N / min(timer.times)
    print(f"before (tf.data map(py_function, AUTOTUNE)): {old_rate:,.0f} samples/s")

    ds = procpipe.tf.dataset(loader)
    print("after: element_spec", {k: (tuple(v.shape), v.dtype.name) for k, v in ds.element_spec.items()})
    print(f"loader epoch after building the dataset: {loader.epoch} (the first batch was looked at, then put back)")
    timer = Timer(keras)
    model = make_model(keras)
    history = model.fit(ds.map(to_xy).prefetch(2), epochs=EPOCHS, verbose=0, shuffle=False,
                        callbacks=[timer.callback])
    new_rate = N / min(timer.times)
    print(f"after (procpipe.tf, 2 workers): {new_rate:,.0f} samples/s ({new_rate / old_rate:.1f}x)")
    print(f"loader epochs run: {loader.epoch} (fit epochs={EPOCHS}); final loss {history.history['loss'][-1]:.3f}")
    first = next(iter(ds))
    print("a batch:", {k: (v.dtype.name, tuple(v.shape)) for k, v in first.items()},
          "caption[0] =", first["caption"][0].numpy().decode())
    loader.close()
    print("closed")
