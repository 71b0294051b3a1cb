"""Every example runs to completion (each in its own interpreter) and prints what it promises."""
from __future__ import annotations

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
    out = run_example("keras_fit.py")
    assert "(torch backend)" in out and "epoch 2:" in out
    assert "same worker processes in every epoch" in out and "predict: (256, 10)" in out


def test_straggler_demo():
    out = run_example("straggler_demo.py")
    assert "ordered=True" in out and "ordered=False" in out
    assert "sloppy order differs from sampler order: True" in out


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py")))
def test_example_has_a_main_guard(name):
    with open(os.path.join(EXAMPLES, name)) as f:
        assert 'if __name__ == "__main__":' in f.read()
