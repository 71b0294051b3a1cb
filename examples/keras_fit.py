"""Keras ``fit`` on a procpipe loader (same synthetic images as torch_training.py).

``procpipe.keras.dataset(loader)`` is the whole adapter: ``fit``, ``evaluate`` and
``predict`` take it like any Keras dataset, ``validation_data`` too. Each Keras epoch is
one epoch of the loader, and the loader's workers persist across epochs (the script
prints their process ids after every epoch), unlike a ``PyDataset`` whose pool restarts
every epoch. Keras' backend must be chosen before Keras is imported; this example uses
torch (``KERAS_BACKEND=torch``) unless the environment says otherwise.

Run: python examples/keras_fit.py
"""
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

import procpipe  # noqa: E402
import procpipe.keras  # noqa: E402

N_TRAIN, N_VAL, BATCH, EPOCHS = 768, 256, 64, 3


def make_image(index):
    """A synthetic labelled image: stripes whose frequency is the class (channels last)."""
    label = index % 10
    rng = np.random.default_rng(index)
    ys, xs = np.mgrid[0:32, 0:32].astype(np.float32) / 32.0
    image = np.empty((32, 32, 3), np.float32)
    for c in range(3):
        phase = rng.uniform(0, 2 * np.pi)
        image[..., c] = np.sin(2 * np.pi * (label + 1) * (xs + ys * (c - 1) * 0.3) + phase)
    image += rng.normal(0.0, 0.3, image.shape).astype(np.float32)
    return image, label


def augmented(index):
    image, label = make_image(index)
    rng = procpipe.sample_rng()
    if rng.random() < 0.5:
        image = image[:, ::-1]
    return np.ascontiguousarray(np.roll(image, rng.integers(-2, 3), axis=0)), np.int64(label)


class EpochReport(keras.callbacks.Callback):
    def __init__(self, loader):
        super().__init__()
        self.loader = loader
        self.pids = []

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.pids.append(tuple(self.loader.worker_pids))
        print(f"  epoch {epoch}: {time.perf_counter() - self.started:.2f} s, loss {logs['loss']:.3f}, "
              f"val_accuracy {logs['val_accuracy']:.2f}, worker pids {list(self.pids[-1])}")


if __name__ == "__main__":
    keras.utils.set_random_seed(0)
    train = procpipe.Loader(range(N_TRAIN), augmented, batch_size=BATCH, workers=2, shuffle=True)
    val = procpipe.Loader(range(N_TRAIN, N_TRAIN + N_VAL), make_image, batch_size=BATCH, workers=1)
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(8, 3, activation="relu", padding="same"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 3, activation="relu", padding="same"), keras.layers.MaxPooling2D(),
        keras.layers.Flatten(), keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    report = EpochReport(train)
    print(f"Keras {keras.__version__} ({keras.backend.backend()} backend), {N_TRAIN} images, batch {BATCH}")
    model.fit(procpipe.keras.dataset(train), validation_data=procpipe.keras.dataset(val), epochs=EPOCHS,
              verbose=0, callbacks=[report])
    loss, accuracy = model.evaluate(procpipe.keras.dataset(val), verbose=0)
    predictions = model.predict(procpipe.keras.dataset(val), verbose=0)
    print(f"evaluate: loss {loss:.3f}, accuracy {accuracy:.2f}; predict: {predictions.shape}")
    assert len(set(report.pids)) == 1, "the workers should be the same processes in every epoch"
    print("same worker processes in every epoch:", report.pids[0])
    train.close()
    val.close()
