"""Keras 3 fit / evaluate / predict through ``procpipe.keras.dataset`` on one backend.

Run by tests/test_keras_backends.py in a fresh interpreter per backend (Keras picks its
backend from ``KERAS_BACKEND`` when it is first imported); prints one ``CHECK name value``
line per fact the test asserts. The loaders are made before Keras (and the backend's
threads) are imported, so that ``start_method="auto"`` forks them: the workers never carry
TensorFlow or JAX.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

import procpipe

N_TRAIN, N_VAL, BATCH, EPOCHS = 96, 48, 16, 2
FEATURES = np.random.default_rng(0).normal(size=(N_TRAIN + N_VAL, 4)).astype(np.float32)


def record(i):
    """A dict record with a str field, as the tf.data question has them."""
    return {"x": FEATURES[i], "id": f"rec-{i}"}, np.int64(FEATURES[i].sum() > 0)


def report(name, value):
    print("CHECK", name, json.dumps(value), flush=True)



def main() -> None:
    train = procpipe.Loader(range(N_TRAIN), record, batch_size=BATCH, workers=2, shuffle=True)
    val = procpipe.Loader(range(N_TRAIN, N_TRAIN + N_VAL), record, batch_size=BATCH, workers=1)
    reference = procpipe.Loader(range(N_TRAIN), record, batch_size=BATCH, workers=0, shuffle=True)
    epoch0 = [list(x["id"]) for x, _ in reference]  # the order of epoch 0

    import keras

    from procpipe.keras import dataset as keras_dataset

    report("backend", keras.backend.backend())
    keras.utils.set_random_seed(0)

    class Batches(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.per_epoch = []

        def on_epoch_begin(self, epoch, logs=None):
            self.per_epoch.append(0)

        def on_train_batch_end(self, batch, logs=None):
            self.per_epoch[-1] += 1

    inputs = {"x": keras.Input((4,), name="x")}
    hidden = keras.layers.Dense(8, activation="relu")(inputs["x"])
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    def drop_id(batch):  # the str field is not a model input: Keras takes the arrays
        x, y = batch
        return {"x": x["x"]}, y

    ds_train = keras_dataset(train)
    if keras.backend.backend() == "tensorflow":
        spec = ds_train.get_tf_dataset().element_spec
        report("tf_spec", {"x": str(spec[0]["x"]), "id": str(spec[0]["id"]), "y": str(spec[1])})
        report("epoch_after_spec", train.epoch)
    counter = Batches()
    history = model.fit(keras_dataset(_Mapped(train, drop_id)), epochs=EPOCHS, verbose=0,
                        validation_data=keras_dataset(_Mapped(val, drop_id)), callbacks=[counter])
    report("batches_per_epoch", counter.per_epoch)
    report("loss_finite", bool(np.all(np.isfinite(history.history["loss"]))))
    report("val_epochs", len(history.history["val_loss"]))
    report("train_epoch", train.epoch)
    report("val_epoch", val.epoch)
    report("last_epoch_stats", [train.stats()["epoch"], train.stats()["batches_consumed"]])

    # the first fit on a fresh model looks at one batch first: that pass is put back
    fresh = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(8)(inputs["x"])))
    fresh.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seen = _Mapped(reference, drop_id, record_ids=True)
    reference.set_epoch(0)
    fresh.fit(keras_dataset(seen), epochs=1, verbose=0)
    report("first_epoch_is_epoch0", [ids for ids in seen.passes if len(ids) == len(epoch0)] == [epoch0])
    report("reference_epoch", reference.epoch)

    loss, accuracy = model.evaluate(keras_dataset(_Mapped(val, drop_id)), verbose=0)
    report("evaluate_finite", bool(np.isfinite(loss) and 0.0 <= accuracy <= 1.0))
    predictions = np.asarray(model.predict(keras_dataset(_Mapped(val, drop_id)), verbose=0))
    direct = np.asarray(model.predict({"x": FEATURES[N_TRAIN:]}, verbose=0))
    report("predict_shape", list(predictions.shape))
    report("predict_matches", bool(np.allclose(predictions, direct, rtol=1e-4, atol=1e-5)))
    for loader in (train, val, reference):
        loader.close()
    report("done", True)


class _Mapped:
    """A loader with a function applied to each batch, keeping its state_dict (so that the
    look at the first batch is put back): what a user's wrapper around a loader would be."""

    def __init__(self, loader, fn, record_ids=False):
        self.loader, self.fn, self.record_ids, self.passes = loader, fn, record_ids, []

    def __len__(self):
        return len(self.loader)

    def __iter__(self):  # starts the loader's iteration at once, as iter(loader) does
        ids = []
        self.passes.append(ids)
        return self._pass(iter(self.loader), ids)

    def _pass(self, batches, ids):
        for batch in batches:
            if self.record_ids:
                ids.append(list(batch[0]["id"]))
            yield self.fn(batch)

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


if __name__ == "__main__":
    assert os.environ.get("KERAS_BACKEND"), "set KERAS_BACKEND"
    main()
    sys.exit(0)
