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


# --------------------------------------------------------------------------- 6: no cycle keeps a loader
def _zeros(i: int) -> np.ndarray:
    return np.zeros(256, np.float32) + i


def _records(shard: list) -> list:
    return shard


@pytest.mark.parametrize("streaming", [False, True], ids=["indexed", "shards"])
def test_abandoned_loader_frees_its_files_without_the_garbage_collector(streaming: bool) -> None:
    import gc
    import weakref

    from conftest import our_shm_files

    before = our_shm_files()
    source = procpipe.Shards([list(range(64)), list(range(64))], _records) if streaming else list(range(128))
    gc.collect()
    gc.disable()  # a re-run notebook cell: the loader is dropped mid-epoch, and no collection runs
    try:
        loader = procpipe.Loader(source, fn=_zeros, batch_size=4, workers=2)
        for k, batch in enumerate(loader):
            if k == 2:
                break
        del batch
        assert our_shm_files() - before, "the loader made no shared-memory files: the test proves nothing"
        gone = weakref.ref(loader)
        del loader
        assert gone() is None, "a reference cycle keeps the abandoned loader alive"
        assert our_shm_files() - before == set()
    finally:
        gc.enable()


# --------------------------------------------------------------------------- 7: device_fn's batch_rng, workers=0
def _shard_records(shard: list) -> list:
    return shard


def _as_float(record: int) -> np.float32:
    return np.float32(record)


def _noisy(batch):
    return batch + float(procpipe.batch_rng().integers(1_000_000))


def test_device_fn_batch_rng_is_the_same_with_and_without_workers_for_a_stream() -> None:
    pytest.importorskip("torch", reason="device= needs torch")

    def run(workers: int) -> list:
        shards = procpipe.Shards([list(range(10)), list(range(10, 20))], _shard_records)
        with procpipe.Loader(shards, fn=_as_float, batch_size=4, workers=workers, device="cpu",
                             device_fn=_noisy, epochs=2) as loader:
            return [batch.tolist() for batch in loader]

    inline, pooled = run(0), run(2)
    assert len(inline) == 10 and inline == pooled
