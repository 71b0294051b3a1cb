"""Comparing batches leaf for leaf (tensors, arrays, containers, dataclasses), types included:
the check test_torch.py and test_torch_parity.py make of procpipe's batches against torch's."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch


def same(a: Any, b: Any, path: str = "batch") -> None:
    """``a`` and ``b`` are equal, leaf for leaf, and of the very same types."""
    assert type(a) is type(b), f"{path}: {type(a)!r} is not {type(b)!r}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{path}: {a} != {b}"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{path}: {a} != {b}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        same(dataclasses.asdict(a), dataclasses.asdict(b), path)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_batches_equal(expected: list, got: list) -> None:
    """The same number of batches, each ``same`` as its counterpart."""
    assert len(expected) == len(got), f"{len(expected)} batches expected, got {len(got)}"
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        same(a, b, f"batch {i}")
