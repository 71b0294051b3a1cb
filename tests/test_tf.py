"""procpipe.tf.dataset: a loader as a tf.data.Dataset (needs TensorFlow: skipped without it;
CI runs it in its second environment, .ci/run).

The exact element_spec (dicts, tuples, namedtuples, str fields, a fixed batch dimension
with drop_last) inferred without consuming the loader's epoch; one pass = one loader
epoch, exactly once; a second live iterator refused; ring slots given back while the
tensors live on; map / prefetch / tf.distribute; clear errors; cleanup with the loader.
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="procpipe.tf needs TensorFlow (pip install procpipe[tf])")

from conftest import REPO_ROOT, loader_token, mappings, python_env  # noqa: E402

import procpipe  # noqa: E402
import procpipe.tf  # noqa: E402

Meta = collections.namedtuple("Meta", ["weight", "tag"])
IMAGE = (4, 4, 3)


def record(i):
    """A dict record with a str field, bytes, a nested namedtuple and a random flip."""
    image = np.full(IMAGE, i % 251, np.uint8)
    image[0, 0, 0] = 255
    if procpipe.sample_rng().random() < 0.5:
        image = image[:, ::-1]
    return {"image": np.ascontiguousarray(image), "label": i % 3, "id": f"rec-{i}",
            "meta": Meta(np.float32(i) / 10, b"t%d" % i)}


def ids_of(batch):
    return [v.decode() if isinstance(v, bytes) else v for v in np.asarray(batch["id"]).tolist()]


def test_element_spec_is_exact_and_costs_no_epoch():
    with procpipe.Loader(range(50), record, batch_size=8, workers=2, shuffle=True) as loader, \
            procpipe.Loader(range(50), record, batch_size=8, workers=0, shuffle=True) as reference:
        ds = procpipe.tf.dataset(loader)
        assert ds.element_spec == {
            "image": tf.TensorSpec((None, *IMAGE), tf.uint8), "label": tf.TensorSpec((None,), tf.int64),
            "id": tf.TensorSpec((None,), tf.string),
            "meta": Meta(tf.TensorSpec((None,), tf.float32), tf.TensorSpec((None,), tf.string))}
        assert loader.epoch == 0, "looking at the first batch put it back"
        first_pass = [ids_of(b) for b in ds]
        assert first_pass == [ids_of(b) for b in reference], "the first pass is epoch 0, in its order"
        assert loader.epoch == 1
    with procpipe.Loader(range(50), record, batch_size=8, workers=1, drop_last=True) as full:
        spec = procpipe.tf.dataset(full).element_spec
        assert spec["image"].shape == (8, *IMAGE) and spec["id"].shape == (8,), "drop_last fixes the batch"
    with procpipe.Loader(range(10), record, batch_size=None, workers=1) as single:
        assert procpipe.tf.dataset(single).element_spec["image"].shape == IMAGE  # unbatched: exact shapes


def test_one_pass_is_one_loader_epoch_exactly_once():
    with procpipe.Loader(range(40), record, batch_size=8, workers=2, shuffle=True) as loader, \
            procpipe.Loader(range(40), record, batch_size=8, workers=0, shuffle=True) as reference:
        ds = procpipe.tf.dataset(loader)
        iter(ds)  # an iterator never asked for an element starts no epoch
        for epoch in range(3):
            seen = [ids_of(b) for b in ds]
            assert seen == [ids_of(b) for b in reference], f"pass {epoch} is loader epoch {epoch}"
            assert sorted(i for b in seen for i in b) == sorted(f"rec-{i}" for i in range(40))
            assert loader.epoch == epoch + 1
        # an abandoned pass ends with its iterator; the next pass is the next epoch
        assert len(list(ds.take(2))) == 2 and loader.epoch == 4
        assert sum(1 for _ in ds) == 5 and loader.epoch == 5


def test_a_second_live_iterator_raises_and_the_first_one_goes_on():
    with procpipe.Loader(range(40), record, batch_size=8, workers=2) as loader:
        ds = procpipe.tf.dataset(loader)
        first = iter(ds)
        assert ids_of(next(first))[0] == "rec-0"
        with pytest.raises(tf.errors.UnknownError, match="a second iterator over this dataset started"):
            next(iter(ds))
        assert [ids_of(b)[0] for b in first] == ["rec-8", "rec-16", "rec-24", "rec-32"], "the first pass went on"
        with pytest.raises(tf.errors.UnknownError, match="a second iterator"):
            list(tf.data.Dataset.zip((ds, ds)))
        assert sum(1 for _ in ds) == 5, "passes work again once the others are gone"


def big(i):
    return np.full(16384, i, np.float32)  # 64 KiB a sample, 512 KiB a batch


@pytest.mark.parametrize("views", [0, 2])
def test_held_tensors_give_their_ring_slots_back(views):
    """A pipeline that keeps every tensor of a pass (40 batches, a ring of ~9 slots) still
    gets every batch through the ring: past ``views`` batches, arrays are copied once and the
    slot goes back. (The old bridge handed ring views to TensorFlow: the slots filled up and
    most batches came through the workers' pipes.)"""
    with procpipe.Loader(range(320), big, batch_size=8, workers=2, stage_slots=views) as loader:
        ds = procpipe.tf.dataset(loader, views=views)
        kept = list(ds)
        assert len(kept) == 40 and all(float(t[0, 0]) == 8 * k for k, t in enumerate(kept))
        stats = loader.stats()
        assert stats["bytes_inline"] <= 2 * 8 * 16384 * 4, stats["bytes_inline"]  # batches before the ring existed
        assert stats["overflow_batches"] == 0 and stats["ring_slots"] < 40
        ring = mappings(loader_token(loader))
        in_ring = [any(lo <= t.numpy().ctypes.data < hi for lo, hi in ring) for t in kept]
        assert sum(in_ring) <= views, f"{sum(in_ring)} tensors still hold ring slots"


def test_composes_with_map_prefetch_and_tf_distribute():
    with procpipe.Loader(range(48), record, batch_size=8, workers=2, drop_last=True) as loader:
        ds = procpipe.tf.dataset(loader)
        mapped = ds.map(lambda b: (tf.cast(b["image"], tf.float32) / 255.0, b["label"])).prefetch(2)
        assert mapped.element_spec[0].shape == (8, *IMAGE)
        labels = np.concatenate([y.numpy() for _, y in mapped])
        np.testing.assert_array_equal(labels, np.arange(48) % 3)
        for strategy in (tf.distribute.get_strategy(), tf.distribute.OneDeviceStrategy("/cpu:0")):
            distributed = strategy.experimental_distribute_dataset(mapped)
            assert sum(int(tf.size(y)) for _, y in distributed) == 48
        assert loader.epoch == 3


def varying(i):
    return {"tokens": np.arange(i % 5 + 1, dtype=np.int32)}


def pad(samples):
    width = max(len(s["tokens"]) for s in samples)
    return {"tokens": np.stack([np.pad(s["tokens"], (0, width - len(s["tokens"]))) for s in samples])}


def test_clear_errors():
    with procpipe.Loader(range(20), varying, batch_size=2, workers=1, collate_fn=pad) as loader:
        ds = procpipe.tf.dataset(loader)  # the first batch has width 2; others are wider
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"batch\['tokens'\] is of shape \(2, 4\).*"
                                                                 r"pass element_spec=\.\.\. with None"):
            list(ds)
        relaxed = procpipe.tf.dataset(loader, element_spec={"tokens": tf.TensorSpec((None, None), tf.int32)})
        assert len(list(relaxed)) == 10
    with procpipe.Loader(range(4), lambda i: {"x": i, "obj": None}, batch_size=2, workers=0) as loader:
        with pytest.raises(ValueError, match=r"batch\['obj'\] is a list of NoneType.*fn or collate_fn"):
            procpipe.tf.dataset(loader)
        with pytest.raises(TypeError, match="element_spec.*is a list"):
            procpipe.tf.dataset(loader, element_spec=[tf.TensorSpec((None,), tf.int64)])
        with pytest.raises(ValueError, match="views must be an int >= 0"):
            procpipe.tf.dataset(loader, element_spec={"x": tf.TensorSpec((None,), tf.int64)}, views=-1)
    with pytest.raises(TypeError, match="cannot infer the element_spec of a list.*element_spec="):
        procpipe.tf.dataset([1, 2, 3])


def test_closed_loader_and_no_tensorflow_in_import_procpipe():
    loader = procpipe.Loader(range(16), record, batch_size=8, workers=1)
    ds = procpipe.tf.dataset(loader)
    assert len(list(ds)) == 2
    loader.close()
    with pytest.raises(tf.errors.UnknownError, match="this procpipe.Loader is closed"):
        list(ds)
    code = "import sys, procpipe; assert 'tensorflow' not in sys.modules, 'import procpipe imported TensorFlow'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT, env=python_env())
    assert result.returncode == 0, result.stderr
    assert os.path.exists(os.path.join(REPO_ROOT, "procpipe", "tf", "__init__.py"))


def test_defaults_get_the_ring_slots_tensorflow_holds():
    """No ceremony: on a loader made with defaults, ``procpipe.tf.dataset`` reserves ``views`` spare
    ring slots (the batches TensorFlow holds, releasing them late), whether the ring exists yet
    or not, so they are not taken from the workers' share; ``views=0`` reserves none."""
    def ring_slots(make):
        with procpipe.Loader(range(320), big, batch_size=8, workers=2) as loader:
            ds = make(loader)
            assert sum(1 for _ in ds) == 40
            return loader.stats()["ring_slots"]

    plain = ring_slots(lambda loader: loader)
    assert ring_slots(procpipe.tf.dataset) == plain + procpipe.tf.VIEWS
    assert ring_slots(lambda loader: procpipe.tf.dataset(loader, views=6)) == plain + 6
    assert ring_slots(lambda loader: procpipe.tf.dataset(loader, views=0)) == plain

    def iterated_first(loader):
        assert sum(1 for _ in loader) == 40  # the ring is made before the dataset
        return procpipe.tf.dataset(loader)

    assert ring_slots(iterated_first) == plain + procpipe.tf.VIEWS


def test_tf_data_autotuning_is_off_so_a_pass_ends_without_waiting():
    """With ``tf.data`` autotuning on, dropping an iterator at a pass's end waits for the
    autotuning thread's timer (about 2 s after a 3-second pass, in a third of the passes: the
    bridge ran at ~0.55x the loader's rate). ``dataset`` turns it off for its pipeline, which a
    downstream ``map``/``prefetch`` keeps; ``autotune=True`` or a later ``with_options`` turns it
    back on."""
    with procpipe.Loader(range(16), record, batch_size=8, workers=1) as loader:
        ds = procpipe.tf.dataset(loader)
        assert ds.options().autotune.enabled is False
        downstream = ds.map(lambda b: b["label"], num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
        assert downstream.options().autotune.enabled is False
        assert sum(int(tf.size(y)) for y in downstream) == 16
        assert procpipe.tf.dataset(loader, autotune=True).options().autotune.enabled is not False
        on = tf.data.Options()
        on.autotune.enabled = True
        assert ds.with_options(on).options().autotune.enabled is True
        with pytest.raises(TypeError, match="autotune must be True or False"):
            procpipe.tf.dataset(loader, autotune="yes")


def _float64_after_the_first_batch(i: int) -> np.ndarray:
    return np.full(3, i, np.float32 if i < 2 else np.float64)


def test_tf_dtype_mismatch_says_to_cast_or_give_the_dtype() -> None:
    with procpipe.Loader(range(6), _float64_after_the_first_batch, batch_size=2, workers=0) as loader:
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            list(procpipe.tf.dataset(loader))  # the spec is the first batch's: float32
    message = str(info.value)
    assert "of dtype float64" in message and "says dtype float32" in message, message
    assert "cast in fn" in message and "element_spec=... with the dtype" in message, message
    assert "None for the dimensions that vary" not in message, message  # (no fix for another cause)
