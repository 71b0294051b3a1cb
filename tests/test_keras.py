"""procpipe.keras with real Keras 3 on the torch backend: fit/evaluate/predict, epochs,
validation_data, steps_per_epoch, and workers that persist across epochs."""
from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "torch"  # before any keras import

import pytest  # noqa: E402

keras = pytest.importorskip("keras", reason="these tests need keras, which is not installed (pip install procpipe[keras])")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.utils.data as tud  # noqa: E402
from conftest import descendants  # noqa: E402

import procpipe  # noqa: E402
import procpipe.keras  # noqa: E402
import procpipe.torch  # noqa: E402

if keras.backend.backend() != "torch":  # pragma: no cover - keras imported earlier with another backend
    pytest.fail(f"Keras was imported with the {keras.backend.backend()} backend before this module set torch")

# Keras' own torch backend converts outputs with np.array(tensor); not procpipe's to fix.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")

FEATURES = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)


def item(i):
    """x carries its index in column 0, so a test can see which samples each pass saw."""
    x = np.concatenate([[np.float32(i)], FEATURES[i]]).astype(np.float32)
    return x, np.int64(FEATURES[i].sum() > 0)


class Recording:
    """A loader as KerasDataset sees it, recording the indices of every pass."""

    def __init__(self, loader):
        self.loader = loader
        self.passes = []

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        seen = []
        self.passes.append(seen)
        for x, y in self.loader:
            seen.extend(int(v) for v in x[:, 0])
            yield x, y


class BatchCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.per_epoch = []

    def on_epoch_begin(self, epoch, logs=None):
        self.per_epoch.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.per_epoch[-1] += 1


def make_model():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


@pytest.fixture
def loaders():
    train = procpipe.Loader(range(96), item, batch_size=16, workers=2, shuffle=True)
    val = procpipe.Loader(range(96, 144), item, batch_size=16, workers=1)
    yield train, val
    train.close()
    val.close()


def test_fit_epochs_with_validation_and_persistent_workers(loaders):
    train, val = loaders
    pids = train.worker_pids + val.worker_pids
    recording_train, recording_val = Recording(train), Recording(val)
    model = make_model()
    counter = BatchCounter()
    history = model.fit(procpipe.keras.dataset(recording_train), validation_data=procpipe.keras.dataset(recording_val),
                        epochs=3, verbose=0, callbacks=[counter])
    assert counter.per_epoch == [6, 6, 6]
    assert len(history.history["loss"]) == 3 and len(history.history["val_loss"]) == 3
    # Keras may peek at one batch first (to build metrics); every full pass is one loader epoch:
    full = [p for p in recording_train.passes if len(p) == 96]
    assert len(full) == 3 and all(sorted(p) == list(range(96)) for p in full)
    assert full[0] != full[1], "each epoch is a new shuffle of the loader"
    val_full = [p for p in recording_val.passes if len(p) == 48]
    assert len(val_full) == 3 and all(p == list(range(96, 144)) for p in val_full)
    # the same worker processes served every epoch (Keras' PyDataset restarts its pool)
    assert train.worker_pids + val.worker_pids == pids and set(pids) <= descendants()

    epoch_before = train.epoch
    model.fit(procpipe.keras.dataset(train), epochs=2, verbose=0)  # model and metrics built: no peek
    assert train.epoch == epoch_before + 2
    assert train.worker_pids + val.worker_pids == pids


def test_steps_per_epoch_continues_the_loader_epoch(loaders):
    train, _ = loaders
    recording = Recording(train)
    model = make_model()
    model.fit(procpipe.keras.dataset(train), epochs=1, verbose=0)  # builds the metrics
    counter = BatchCounter()
    model.fit(procpipe.keras.dataset(recording), epochs=4, steps_per_epoch=3, verbose=0, callbacks=[counter])
    assert counter.per_epoch == [3, 3, 3, 3]
    assert len(recording.passes) == 2 and all(sorted(p) == list(range(96)) for p in recording.passes)


def test_evaluate_and_predict_follow_the_loader_order(loaders):
    _, val = loaders
    model = make_model()
    loss, accuracy = model.evaluate(procpipe.keras.dataset(val), verbose=0)
    assert np.isfinite(loss) and 0.0 <= accuracy <= 1.0
    predictions = model.predict(procpipe.keras.dataset(val), verbose=0)
    direct = model.predict(np.stack([item(i)[0] for i in range(96, 144)]), verbose=0)
    np.testing.assert_allclose(predictions, direct, rtol=1e-5, atol=1e-6)


def test_pydataset_protocol_streams_loader_epochs(loaders):
    _, val = loaders
    ds = procpipe.keras.dataset(val)
    assert isinstance(ds, keras.utils.PyDataset) and len(ds) == ds.num_batches == 3
    firsts = [int(ds[i][0][0, 0]) for i in range(7)]  # the index is ignored: one stream of epochs
    assert firsts == [96, 112, 128, 96, 112, 128, 96]
    with pytest.raises(ValueError, match=r"\(x,\), \(x, y\)"):
        procpipe.keras._standardize((1, 2, 3, 4))


class TorchItems(tud.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x, y = item(i)
        return torch.from_numpy(x), int(y)


def test_fit_accepts_the_torch_facade_directly():
    loader = procpipe.torch.DataLoader(TorchItems(), batch_size=16, num_workers=2, persistent_workers=True)
    try:
        model = make_model()
        counter = BatchCounter()
        model.fit(loader, epochs=2, shuffle=False, verbose=0, callbacks=[counter])  # Keras sees a torch DataLoader
        assert counter.per_epoch == [4, 4]
        pids = loader.worker_pids
        model.fit(procpipe.keras.dataset(loader), epochs=1, verbose=0)
        assert loader.worker_pids == pids and len(pids) == 2
    finally:
        loader.close()
