"""Issue 21 (hardening, third round): each test reproduces one defect found on main."""
from __future__ import annotations

import numpy as np
import pytest

import procpipe
from procpipe.errors import CollateError


# --------------------------------------------------------------------------- 1: unpicklable sample
def _with_generator(i: int) -> dict:
    return {"x": np.float32(i), "g": (k for k in range(3)) if i == 5 else None}


def test_unpicklable_value_is_its_batchs_error_and_the_worker_lives() -> None:
    loader = procpipe.Loader(list(range(16)), fn=_with_generator, batch_size=4, workers=2, max_worker_restarts=0)
    it = iter(loader)
    got, errors = [], []
    for _ in range(4):
        try:
            got.append(next(it)["x"].tolist())
        except CollateError as exc:
            errors.append(str(exc))
    with pytest.raises(StopIteration):
        next(it)
    assert len(errors) == 1 and "sample['g'] of index 5" in errors[0] and "generator" in errors[0], errors
    assert "pickle" in errors[0]
    assert sorted(got) == [[0.0, 1.0, 2.0, 3.0], [8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0]]
    assert loader.stats()["worker_deaths"] == 0
    loader.close()
