"""The device stage: ``device_fn`` (CPU and CUDA), and on a CUDA machine the registered-ring
path (batches copied straight from their ring slot), its staging fallback, ring growth
under registration, and the facade's ``pin_memory``. The CUDA tests skip without CUDA."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from conftest import loader_token, mappings

import procpipe
import procpipe.torch.cuda_transfer as ppc
from procpipe.torch import DataLoader

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
WIDTH = 4096


def sample(i):
    """A sample whose every byte depends on its index: content checks see any mix-up."""
    return {"x": ((np.arange(WIDTH, dtype=np.int64) + 7 * i) % 251).astype(np.uint8), "y": np.int64(i)}


def expected(y: torch.Tensor) -> torch.Tensor:
    return ((torch.arange(WIDTH, device=y.device)[None, :] + 7 * y[:, None]) % 251).to(torch.uint8)


def tagged(batch):
    """A device_fn: the batch scaled, plus a draw of batch_rng() tagged by the batch's first index."""
    rng = procpipe.batch_rng()
    return {"x": batch["x"].float() * 2, "y": batch["y"], "r": int(rng.integers(1 << 62))}


# --------------------------------------------------------------------------- CPU
def test_device_fn_is_validated_where_arguments_are():
    with pytest.raises(ValueError, match="device_fn runs on batches once they are on a device"):
        procpipe.Loader(range(8), batch_size=2, workers=0, device_fn=lambda b: b)
    with pytest.raises(TypeError, match="device_fn must be callable or None"):
        procpipe.Loader(range(8), batch_size=2, workers=0, device="cpu", device_fn=3)


def draws(workers, ordered, device, epochs=2):
    out = {}
    with procpipe.Loader(range(64), sample, batch_size=8, workers=workers, ordered=ordered, shuffle=True, seed=3,
                         device=device, device_fn=tagged) as loader:
        for epoch in range(epochs):
            for batch in loader:
                y = batch["y"].cpu()
                assert torch.equal(batch["x"].cpu(), expected(y).float() * 2)
                out[(epoch, int(y[0]))] = batch["r"]
    return out


def test_device_fn_batch_rng_does_not_depend_on_workers_or_order_cpu():
    reference = draws(0, True, "cpu")
    assert len(reference) == 16 and len(set(reference.values())) == 16  # differs by batch and epoch
    assert draws(2, False, "cpu") == reference


def test_sample_rng_is_refused_in_device_fn():
    def bad(batch):
        procpipe.sample_rng()

    with procpipe.Loader(range(8), sample, batch_size=4, workers=0, device="cpu", device_fn=bad) as loader:
        with pytest.raises(RuntimeError, match="sample_rng\\(\\) was called inside device_fn") as info:
            next(iter(loader))
    assert "raised by device_fn on batch 0 of epoch 0" in "".join(getattr(info.value, "__notes__", []))


class Done:
    """A copy event that has completed."""

    def query(self):
        return True

    def synchronize(self):
        pass


def test_staging_pool_reuses_buffers_of_several_sizes():
    pool = ppc._StagingPool(lambda n: torch.zeros(n, dtype=torch.uint8), capacity=3)
    small, large = pool.take(10), pool.take(20)
    pool.give(small, Done())
    pool.give(large, Done())
    assert pool.take(15) is large  # the smallest free buffer that fits (it used to compare tensors and raise)
    assert pool.take(5) is small
    bigger = pool.take(40)  # a third allocation: capacity allows it
    pool.give(small, Done())
    pool.give(bigger, Done())
    assert pool.take(50).numel() == 50 and pool.allocations == 4  # the too-small one was dropped


# --------------------------------------------------------------------------- CUDA
def busy(stream_work: torch.Tensor) -> None:
    """Queue heavy work on the consumer's stream, so copies that did not wait would show."""
    for _ in range(4):
        stream_work = stream_work @ stream_work


@CUDA
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("path", ["direct", "staged"])
def test_cuda_batches_are_exact_under_slot_reuse_with_a_busy_consumer(ordered, path, monkeypatch):
    if path == "staged":  # registration refused: the staging fallback
        monkeypatch.setattr(ppc.RingPins, "find", lambda self, ring: None)
    work = torch.randn(2048, 2048, device="cuda")
    seen = []
    with procpipe.Loader(range(600), sample, batch_size=8, workers=3, prefetch=1, ordered=ordered,
                         device="cuda", epochs=2) as loader:
        for batch in loader:
            busy(work)
            assert batch["x"].is_cuda and batch["y"].is_cuda
            assert torch.equal(batch["x"], expected(batch["y"]))
            seen.extend(batch["y"].tolist())
        info = loader.stats()["device"]
        slots = loader.stats()["ring_slots"]
    assert sorted(seen) == sorted(list(range(600)) * 2)
    assert len(seen) // 8 > 4 * slots  # every slot was reused several times
    # The first batches (at most one per worker) come through the pipes, before the ring exists:
    # they are not in a ring, so they take the staging path.
    if path == "direct":
        assert info["staged_batches"] <= 3 and info["direct_batches"] == 150 - info["staged_batches"]
        assert info["registrations"] == 1
    else:
        assert info["direct_batches"] == 0 and info["staged_batches"] == 150


@CUDA
def test_cuda_registration_is_released_and_the_ring_unmapped_on_close():
    gc.disable()  # unmapped by reference counting alone, not when the cycle collector happens to run
    try:
        loader = procpipe.Loader(range(64), sample, batch_size=8, workers=2, device="cuda")
        prefix = loader_token(loader)
        batches = list(loader)
        assert loader.stats()["device"]["registered_rings"] == 1
        assert torch.equal(batches[3]["x"], expected(batches[3]["y"]))
        loader.close()
        assert loader.stats()["device"]["registered_rings"] == 0
        assert mappings(prefix) == []  # unregistered, then unmapped (the loader object still lives)
        del loader, batches
    finally:
        gc.enable()


def growing(i):
    size = 4096 if i < 160 else 3 * 4096  # from batch 20 on: the first ring is registered by then
    return ((np.arange(size) + i) % 251).astype(np.uint8)


@CUDA
def test_cuda_ring_growth_registers_the_new_ring_and_releases_the_old():
    with procpipe.Loader(range(256), growing, batch_size=8, workers=2, prefetch=1, device="cuda") as loader:
        for k, batch in enumerate(loader):
            idx = torch.arange(8 * k, 8 * k + 8, device="cuda")
            width = batch.shape[1]
            assert torch.equal(batch, ((torch.arange(width, device="cuda")[None, :] + idx[:, None]) % 251).to(torch.uint8))
        info = loader.stats()["device"]
        assert loader.stats()["ring_slot_bytes"] >= 8 * 3 * 4096
    assert info["registrations"] == 2 and info["registered_rings"] == 1  # the retired one was unregistered


@CUDA
def test_cuda_device_fn_runs_on_the_device_and_is_deterministic():
    reference = draws(0, True, "cuda")
    assert draws(3, False, "cuda") == reference
    assert reference == draws(0, True, "cpu")  # the same seeds on CPU and GPU


class Images(tud.Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        return torch.full((3, 16, 16), i % 256, dtype=torch.uint8), i


@CUDA
@pytest.mark.parametrize("num_workers", [0, 2])
def test_facade_pin_memory_yields_pinned_batches_equal_to_torch(num_workers):
    got = list(DataLoader(Images(), batch_size=8, pin_memory=True, num_workers=num_workers))
    want = list(tud.DataLoader(Images(), batch_size=8, pin_memory=True))
    assert len(got) == len(want) == 12
    for (x, y), (wx, wy) in zip(got, want, strict=True):
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x, wx) and torch.equal(y, wy)


@CUDA
def test_facade_device_cuda_is_exact_with_a_busy_consumer():
    work = torch.randn(2048, 2048, device="cuda")
    loader = DataLoader(Images(), batch_size=8, num_workers=2, device="cuda", persistent_workers=True)
    try:
        for _ in range(2):
            for n, (x, y) in enumerate(loader):
                busy(work)
                assert x.is_cuda and torch.equal(y.cpu(), torch.arange(8 * n, 8 * n + 8))
                assert torch.equal(x, (y % 256).to(torch.uint8)[:, None, None, None].expand(8, 3, 16, 16))
    finally:
        loader.close()


@CUDA
def test_facade_cuda_ring_has_slots_for_the_transfer_and_close_unmaps_it_without_gc():
    def ring_slots(**device):
        loader = DataLoader(Images(), batch_size=8, num_workers=2, persistent_workers=True, **device)
        try:
            next(iter(loader))
            return loader.stats()["ring_slots"]
        finally:
            loader.close()

    assert ring_slots(device="cuda") == ring_slots() + ppc.CudaTransfer.SLOTS_HELD
    gc.disable()  # the ring must go by reference counting alone
    try:
        loader = DataLoader(Images(), batch_size=8, num_workers=2, device="cuda", persistent_workers=True)
        batches = list(loader)
        prefix = loader_token(loader._pp_current)
        assert mappings(prefix)
        loader.close()  # the transfer's registrations end first, then the ring goes
        assert mappings(prefix) == []
        del batches, loader
    finally:
        gc.enable()


@CUDA
def test_facade_cuda_iteration_after_close_copies_straight_from_the_ring_again():
    loader = DataLoader(Images(), batch_size=8, num_workers=2, device="cuda", persistent_workers=True)
    try:
        assert len(list(loader)) == 12
        loader.close()
        for n, (x, y) in enumerate(loader):  # new workers, a new ring, a new transfer
            assert torch.equal(x, (y % 256).to(torch.uint8)[:, None, None, None].expand(8, 3, 16, 16))
            assert torch.equal(y.cpu(), torch.arange(8 * n, 8 * n + 8))
        assert n == 11
        assert loader._pp_transfer is not None and loader._pp_transfer.direct_batches > 0  # before: pins stayed None
    finally:
        loader.close()


# --------------------------------------------------------------------------- device_fn's batch_rng, workers=0
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
