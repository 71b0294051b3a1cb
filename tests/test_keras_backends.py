"""procpipe.keras on each Keras 3 backend (tensorflow, jax, torch): fit with validation_data,
evaluate and predict, each backend in its own interpreter (Keras reads KERAS_BACKEND once,
at import). tests/keras_backend_check.py runs the model and prints ``CHECK name value``
lines; this asserts them. A backend whose package is not installed is skipped (CI installs
TensorFlow and JAX in a second environment: .ci/run)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, python_env

CHECK = os.path.join(REPO_ROOT, "tests", "keras_backend_check.py")
PACKAGES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}
EXTRAS = {"keras": "keras", "tensorflow": "tf", "jax": "jax", "torch": "torch"}  # the extra that installs each package


def run_backend(backend: str) -> dict:
    for package in ("keras", PACKAGES[backend]):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"the {backend} backend needs {package}, which is not installed "
                        f"(pip install procpipe[{EXTRAS[package]}])")
    try:
        result = subprocess.run([sys.executable, CHECK], capture_output=True, text=True, timeout=240, cwd=REPO_ROOT,
                                env=python_env(KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2"))
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"keras_backend_check.py ({backend}) did not finish in 240 s:\n{exc.stdout}\n{exc.stderr}")
    assert result.returncode == 0, f"{backend} backend failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    checks = {}
    for line in result.stdout.splitlines():
        if line.startswith("CHECK "):
            _, name, value = line.split(" ", 2)
            checks[name] = json.loads(value)
    assert checks.get("done"), result.stdout
    return checks


@pytest.mark.timeout_s(300)
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_fit_evaluate_predict(backend):
    checks = run_backend(backend)
    assert checks["backend"] == backend
    assert checks["batches_per_epoch"] == [6, 6] and checks["val_epochs"] == 2 and checks["loss_finite"]
    # each Keras epoch is one loader epoch, and no more: the look at one batch to build the
    # model and metrics is put back (the old adapter ended at epochs + 1)
    assert checks["train_epoch"] == 2 and checks["val_epoch"] == 2
    assert checks["last_epoch_stats"] == [1, 6], "the last epoch run was epoch 1, consumed whole"
    assert checks["first_epoch_is_epoch0"] and checks["reference_epoch"] == 1
    assert checks["evaluate_finite"] and checks["predict_shape"] == [48, 2] and checks["predict_matches"]
    if backend == "tensorflow":  # dict batches with a str field: the spec is exact, and costs no epoch
        assert checks["tf_spec"] == {"x": "TensorSpec(shape=(None, 4), dtype=tf.float32, name=None)",
                                     "id": "TensorSpec(shape=(None,), dtype=tf.string, name=None)",
                                     "y": "TensorSpec(shape=(None,), dtype=tf.int64, name=None)"}
        assert checks["epoch_after_spec"] == 0
