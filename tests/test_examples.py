"""Every example runs to completion (each in its own interpreter) and prints what it promises."""
from __future__ import annotations

import importlib.util
import os

import pytest
from conftest import REPO_ROOT, run_python

EXAMPLES = os.path.join(REPO_ROOT, "examples")


def run_example(name: str) -> str:
    result = run_python([os.path.join(EXAMPLES, name)], timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_dict_preprocessing():
    out = run_example("dict_preprocessing.py")
    assert "identical output with 1 and 2 workers: yes" in out
    assert "'id': 'list[16]'" in out and "'tokens': 'array(16, 8) int64'" in out


def test_torch_training():
    out = run_example("torch_training.py")
    for loader in ("torch.utils.data.DataLoader", "procpipe.torch.DataLoader"):
        assert f"{loader:28} epoch 1:" in out
    assert "time per epoch (s):" in out and "mean over epochs: torch" in out


def test_keras_fit():
    pytest.importorskip("keras", reason="the example needs keras, which is not installed (pip install procpipe[keras])")
    out = run_example("keras_fit.py")
    assert "(torch backend)" in out and "epoch 2:" in out
    assert "same worker processes in every epoch" in out and "predict: (256, 10)" in out


def test_tf_data_pipeline():
    pytest.importorskip("tensorflow", reason="the example needs TensorFlow (pip install procpipe[tf])")
    # (found, not imported: this process's keras reads KERAS_BACKEND=torch, conftest.py; the example runs
    # in a process of its own on the TensorFlow backend)
    if importlib.util.find_spec("keras") is None:
        pytest.skip("the example needs keras, which is not installed (pip install procpipe[tf])")
    out = run_example("tf_data_pipeline.py")
    spec = "element_spec {'image': ((None, 32, 32, 3), 'uint8'), 'label': ((None,), 'int64'), " \
           "'caption': ((None,), 'string')}"
    assert f"before: {spec}" in out and f"after: {spec}" in out
    assert "(tensorflow backend)" in out and "before (tf.data map(py_function, AUTOTUNE)):" in out
    assert "loader epoch after building the dataset: 0" in out
    assert "after (procpipe.tf, 2 workers):" in out and "loader epochs run: 2 (fit epochs=2)" in out
    assert "caption[0] = a picture of class" in out and out.rstrip().endswith("closed")


def test_jax_flax():
    for package, why in (("jax", "JAX (pip install procpipe[jax])"), ("flax", "Flax"), ("optax", "Optax"),
                         ("orbax.checkpoint", "orbax-checkpoint")):
        pytest.importorskip(package, reason=f"the example needs {why}, which is not installed")
    out = run_example("jax_flax.py")
    assert "devices: 2, batch sharding: P('data',)" in out
    assert "batch image (64, 64) float32 over 2 devices, names stay a list of str" in out
    assert "epoch 1: saved after 6 batches (384 samples)" in out and "resumed at epoch 1, batch 6" in out
    assert "epoch 1 across the restart: 1024 samples, each once: yes" in out


def test_straggler_demo():
    out = run_example("straggler_demo.py")
    assert "ordered=True" in out and "ordered=False" in out
    assert "sloppy order differs from sampler order: True" in out


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")))
def test_example_has_a_main_guard(name):
    with open(os.path.join(EXAMPLES, name)) as f:
        assert 'if __name__ == "__main__":' in f.read()


def test_records_metadata():
    out = run_example("records_metadata.py")
    assert "<procpipe.Records: 200000 dict records (path: str, label: int64, width: int64)" in out
    assert "labels: 100 classes, 2000 to 2000 images each" in out
    pickled = out.split("pickled dataset:")[1].split("\n")[0]  # "list 8.5 MiB, Records 146 bytes"
    assert pickled.endswith(" bytes") and int(pickled.split()[-2]) < 1000, pickled
    assert "workers grew less with Records: yes" in out and "same records: True" in out


def test_cache_and_batch_fn():
    out = run_example("cache_and_batch_fn.py")
    assert "cache: 1000 samples x 776 bytes in shared memory, 1 filled at creation" in out
    assert "epoch 2: 1000 samples in" in out and "batch image float32 (40, 16, 16, 3)" in out
    assert "cache filled: 1000/1000" in out
    assert "identical to an uncached run with workers=0: yes" in out


def test_text_zip():
    out = run_example("text_zip.py")
    assert "200 (sentence, label) pairs in 13 batches; tokens (16, 8) int32, labels int64" in out
    assert "zipped line by line, in file order: True" in out
    assert "same order with 1 and 2 workers: True" in out


def test_epochs_autotune():
    out = run_example("epochs_autotune.py")
    for epoch in range(3):
        assert f"epoch {epoch}: 1200 samples, every index once: True" in out
    assert "epoch 3" not in out and "orders differ between epochs: True" in out
    assert "t=" in out and "workers=" in out  # the autotune trace was recorded


def test_resume_after_preemption():
    out = run_example("resume_after_preemption.py")
    assert "job 1: killed by SIGKILL after 1500 records" in out
    assert "last checkpoint: 1280 records" in out
    assert "left behind by the killed job (workers, /dev/shm files): []" in out
    assert "job 2: resumed from a checkpoint after 1280 records" in out
    assert "records trained on: 3000 of 3000, every record exactly once: True" in out
    assert "same batches, in the same order, as an uninterrupted run: True" in out


def test_jpeg_training():
    out = run_example("jpeg_training.py")  # CPU, small: device_fn augments on the CPU device
    assert "device=cpu" in out and "images/s" in out and "overflow batches: 0" in out


@pytest.mark.timeout_s(330)
@pytest.mark.xdist_group("ray")  # with test_ray.py: one Ray cluster at a time under pytest-xdist
def test_ray_cluster():
    pytest.importorskip("ray", reason="the example needs ray (pip install procpipe[ray])")
    result = run_python([os.path.join(EXAMPLES, "ray_cluster.py")], timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, f"ray_cluster.py failed:\n{result.stdout}\n{result.stderr}"
    out = result.stdout
    assert "local cluster: a head (0 CPUs) and 2 nodes of 1 CPU" in out
    for epoch in range(2):
        assert f"epoch {epoch}: 20 batches, " in out
    assert "keys ['features', 'id', 'label'], features float32 (16, 8)" in out
    assert "agents: 2 on 2 nodes" in out and out.count("ready True") == 2
    assert "state_dict after 5 batches of epoch 2; the cluster then gave 15 more" in out
    assert "resumed on a local loader (workers=2): 15 batches, identical to the cluster's: yes" in out
    assert out.rstrip().endswith("closed: loaders, agents and cluster")
