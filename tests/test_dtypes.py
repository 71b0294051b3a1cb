"""Data comes back exactly as produced: structured dtypes, non-native byte order, and the dtypes of
streaming batches joined across blocks, on every path (workers or not, cached or not)."""
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
    # the ring; with slot_bytes=4096 the first batches (16 KB) overflow their slots and come
    # inline until the ring has grown, the rest through the grown ring.
    expected = {"x": np.dtype(">i4"), "y": np.dtype(">f8")}
    for slot_bytes in ((None,) if workers == 0 else (None, 4096)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the overflow warning
            with Loader(list(range(N)), big_endian, batch_size=BS, workers=workers,
                        slot_bytes=slot_bytes) as loader:
                batches = list(loader)
                overflows = loader.stats()["overflow_batches"]
        if slot_bytes:
            assert overflows >= 1  # the inline path was taken
        else:
            assert overflows == 0
        for k, b in enumerate(batches):
            assert {key: b[key].dtype for key in b} == expected, (slot_bytes, k)
            assert b["x"][:, 0].tolist() == list(range(k * BS, (k + 1) * BS))


def exact_dtype_shard(shard):
    for i in range(shard[1]):
        rid = shard[0] * 1000 + i
        yield {"x": np.array([rid, -rid], ">i4"), "s": structured(rid)}


@pytest.mark.parametrize("workers", [0, 2])
def test_streaming_batches_joined_across_blocks_keep_the_produced_dtypes(workers):
    from procpipe import Shards

    # batch_size 3 with blocks of 4: most batches span two blocks and are joined (copied).
    shards = [(0, 8), (1, 8), (2, 5)]
    with Loader(Shards(shards, exact_dtype_shard, cycle_length=2, block_length=4), batch_size=3,
                workers=workers) as loader:
        batches = list(loader)
    assert sum(len(b["x"]) for b in batches) == 21
    for b in batches:
        assert (b["x"].dtype, b["s"].dtype) == (np.dtype(">i4"), STRUCT)
        assert b["s"]["b"][:, 0].tolist() == b["x"][:, 0].tolist()
