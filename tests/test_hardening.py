"""Hardening: data comes back exactly as produced, outside inputs are validated, and every
file procpipe creates is owner-only, never followed, and tamper-evident (cache checksums)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from procpipe import Loader

N, BS = 40, 4
STRUCT = np.dtype([("a", "<f4"), ("b", "<i4")])


def structured(i):
    x = np.zeros(3, STRUCT)
    x["a"], x["b"] = i + 0.5, i
    return x


def big_endian(i):
    return {"x": (np.arange(1000) + i).astype(">i4"), "y": np.full((2,), i, ">f8")}  # 4 KB a sample


# ------------------------------------------------------------------ 5. data exactly as produced
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cache", [False, True])
def test_structured_dtype_survives_every_batch(workers, cache):
    with Loader(list(range(N)), structured, batch_size=BS, workers=workers, cache=cache) as loader:
        batches = list(loader)
    assert len(batches) == N // BS
    for k, b in enumerate(batches):
        assert b.dtype == STRUCT
        assert b["b"].tolist() == [[i] * 3 for i in range(k * BS, (k + 1) * BS)]
        assert np.allclose(b["a"][:, 0], np.arange(k * BS, (k + 1) * BS) + 0.5)


@pytest.mark.parametrize("workers", [0, 2])
def test_non_native_byte_order_is_kept_on_every_path(workers):
    # With workers, the first batches come inline (before the ring exists), the rest through
    # the ring; with slot_bytes=4096 every batch (16 KB) overflows its slot and comes inline.
    expected = {"x": np.dtype(">i4"), "y": np.dtype(">f8")}
    for slot_bytes in ((None,) if workers == 0 else (None, 4096)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the overflow warning
            with Loader(list(range(N)), big_endian, batch_size=BS, workers=workers,
                        slot_bytes=slot_bytes) as loader:
                batches = list(loader)
                overflows = loader.stats()["overflow_batches"]
        assert overflows == (N // BS if slot_bytes else 0)
        for k, b in enumerate(batches):
            assert {key: b[key].dtype for key in b} == expected, (slot_bytes, k)
            assert b["x"][:, 0].tolist() == list(range(k * BS, (k + 1) * BS))


class Interrupted(BaseException):
    """A user exception outside ``Exception`` (like KeyboardInterrupt): must keep its type."""


def interrupt_at_13(i):
    if i == 13:
        raise Interrupted(f"stop at {i}")
    return np.full(2, i)


@pytest.mark.parametrize("workers", [0, 2])
def test_base_exception_from_fn_keeps_its_type(workers):
    with Loader(list(range(N)), interrupt_at_13, batch_size=BS, workers=workers) as loader:
        with pytest.raises(Interrupted, match="stop at 13"):
            list(loader)
        stats = loader.stats()
        assert stats["worker_deaths"] == 0  # reported like any exception, not by dying
        assert all(w["restarts"] == 0 for w in stats["per_worker"])
