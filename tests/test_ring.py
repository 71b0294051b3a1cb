"""Ring slot sizing and growth: a short batch never sizes the slots, and a batch larger than
its slot makes the ring grow (a new generation) instead of sending every later batch of
that size through the workers' pipes."""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from conftest import loader_token, mappings, segment_fds, segments, warnings_as_errors

import procpipe
import procpipe._core.rings
import procpipe._core.shm


def image(i):
    return np.full((64, 64, 3), i % 256, np.uint8)


def check_batches(batches, plan):
    assert [b[:, 0, 0, 0].tolist() for b in batches] == [[i % 256 for i in idx] for idx in plan]


def test_short_batch_first_does_not_size_the_slots():
    # One worker runs the tasks in order, so the 1-sample batch is the first to arrive.
    plan = [[0]] + [list(range(1 + 8 * k, 9 + 8 * k)) for k in range(12)]
    with warnings_as_errors():  # the overflow warning would fail the test
        with procpipe.Loader(range(200), image, batch_size=1, workers=1, batches=lambda e: plan) as loader:
            batches = list(loader)
            stats = loader.stats()
    check_batches(batches, plan)
    assert stats["overflow_batches"] == 0
    assert stats["ring_slot_bytes"] >= 8 * 64 * 64 * 3


def test_issue_repro_many_workers_few_batches():
    # The short last batch (300 = 9 * 32 + 12) often finishes first with 12 workers.
    with warnings_as_errors():
        with procpipe.Loader(range(300), image, batch_size=32, workers=12, shuffle=True) as loader:
            assert sum(len(b) for b in loader) == 300
            stats = loader.stats()
    assert stats["overflow_batches"] == 0
    assert stats["ring_slot_bytes"] >= 32 * 64 * 64 * 3


def growing(i):
    """Samples of batch k (4 per batch) are small for the first 10 batches, 3x larger after."""
    size = 4096 if i < 40 else 3 * 4096
    return np.full(size, i % 251, np.uint8)


def test_ring_grows_when_batches_outgrow_their_slots():
    with warnings_as_errors():
        with procpipe.Loader(range(160), growing, batch_size=4, workers=1, prefetch=1) as loader:
            token = loader_token(loader)
            first_slot_bytes = None
            out = []
            for batch in loader:
                if first_slot_bytes is None:
                    first_slot_bytes = loader.stats()["ring_slot_bytes"]
                out.append(batch[:, 0].tolist())
                del batch
            stats = loader.stats()
            rings = sorted(name[len(token) :] for name in segments() if name.startswith(token) and "ring" in name)
    assert out == [[i % 251 for i in range(4 * k, 4 * k + 4)] for k in range(40)]
    assert stats["ring_slot_bytes"] >= 4 * 3 * 4096 > first_slot_bytes
    # Only the batches already dispatched into the small ring when the first large one came
    # back overflow (before the fix: all 30 large ones).
    assert 1 <= stats["overflow_batches"] <= 8
    assert stats["bytes_in_slots"] >= 20 * 4 * 3 * 4096
    assert rings == ["ring1"]  # the retired generation was removed once its slots came back
    assert stats["ring_growths"] == 1 and stats["ring_growth_s"] > 0  # its cost on the coordinator thread


def test_ring_growth_refused_by_the_preflight_warns_and_stays_inline(monkeypatch):
    real = procpipe._core.shm.check_memory
    limit = {"bytes": None}

    def capped(needed, what, fixes):
        if limit["bytes"] is not None and needed > limit["bytes"]:
            raise procpipe.SharedMemoryError(f"procpipe needs {needed} bytes of memory for {what} (test cap)")
        real(needed, what, fixes)

    monkeypatch.setattr(procpipe._core.shm, "check_memory", capped)
    with procpipe.Loader(range(160), growing, batch_size=4, workers=1, prefetch=1) as loader:
        it = iter(loader)
        first = next(it)
        limit["bytes"] = loader.stats()["ring_slots"] * loader.stats()["ring_slot_bytes"]  # no room to grow
        with pytest.warns(RuntimeWarning, match="did not fit the ring.*A larger ring did not fit.*test cap"):
            rest = [b[:, 0].tolist() for b in it]  # (holding the batches would hold their slots)
        stats = loader.stats()
    out = [first[:, 0].tolist()] + rest
    assert out == [[i % 251 for i in range(4 * k, 4 * k + 4)] for k in range(40)]
    assert stats["overflow_batches"] == 30  # every large batch, through the pipes
    assert stats["ring_slot_bytes"] < 4 * 3 * 4096
    assert stats["ring_growths"] == 0


@pytest.fixture
def no_gc():
    """The cycle collector off: what is freed must be freed by reference counting alone."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def test_a_removed_ring_is_unmapped_when_its_last_user_dies_without_the_cycle_collector(no_gc):
    memory = procpipe._core.shm.Segments()
    ring = procpipe._core.rings.Ring(memory, 0, 4, procpipe._core.shm.PAGE)
    released = []
    lease = ring.lease(2, released.append)
    batch = np.frombuffer(lease, np.uint8)
    assert procpipe._core.rings.ring_of(batch) is ring
    exporter = ring.exporter()  # (what a CUDA registration holds)
    ring.remove()  # in use: the mapping is deferred (its mmap keeps a descriptor); the ring's is closed now
    assert mappings(memory.token) and ring.fd == -1
    del ring, lease, batch
    assert released == [2] and mappings(memory.token)  # the exporter still holds it
    del exporter
    # before the fix: mapped until gc.collect(); nothing holds the memory now
    assert mappings(memory.token) == [] and segment_fds(memory.token) == []


def test_a_closed_loaders_ring_is_unmapped_when_the_last_batch_dies_without_the_cycle_collector(no_gc):
    loader = procpipe.Loader(range(64), image, batch_size=8, workers=1)
    prefix = loader_token(loader)
    batches = list(loader)
    loader.close()
    assert mappings(prefix)  # the batches still read the ring
    del batches
    assert mappings(prefix) == []  # while the loader object lives on (before the fix: it held the map)


def _ring_segments(memory, generations, slot_bytes):
    """Two-slot rings 0 .. ``generations - 1``: their descriptors."""
    return [memory.new(f"ring{g}", 2 * slot_bytes, "test ring") for g in range(generations)]


def fails_on_5(i):
    if i == 5:
        raise ValueError("sample 5")
    return np.full(16, i, np.uint8)


@pytest.mark.parametrize("skip", [False, True], ids=["failed", "skipped-sample"])
def test_a_worker_unmaps_the_old_ring_after_a_failed_batch(no_gc, skip):
    """The last task on ring 0 fails (or skips a sample, whose traceback holds the task's
    frame); the next names ring 1: ring 0 must not stay mapped."""
    import multiprocess
    import psutil

    from procpipe._core import wire
    from procpipe._core.messages import STOP, MapRing, Task
    from procpipe._core.rings import WorkerRings
    from procpipe._core.shm import PAGE
    from procpipe._worker.process import _ParentWatch, _serve
    from procpipe._worker.index_producer import IndexProducer
    from procpipe._worker.worker_spec import WorkerSpec

    memory = procpipe._core.shm.Segments()
    fds = _ring_segments(memory, 2, PAGE)
    ours, theirs = multiprocess.Pipe(duplex=True)
    # (each ring's descriptor travels with its MapRing, as the coordinator sends it: SCM_RIGHTS)
    for message, sent in [(MapRing(0, 2 * PAGE), [fds[0]]), (Task(1, 0, [0], 0, 0, PAGE), []),
                          (Task(2, 0, [4, 5], 0, 1, PAGE), []), (MapRing(1, 2 * PAGE), [fds[1]]),
                          (Task(3, 0, [1], 1, 0, PAGE), []), (STOP, [])]:
        wire.send(ours, message, sent)
    for fd in fds:
        os.close(fd)  # (the worker holds its own copies now)
    spec = WorkerSpec(source=range(8), producer=IndexProducer(range(8)), fn=fails_on_5, collate_fn=None, batched=True,
                      seed=0, seed_globals=None, skip=skip)
    rings = WorkerRings()
    _serve(theirs, spec, rings, _ParentWatch(os.getpid(), psutil.Process().create_time()), [-1, -1])
    replies = []
    while ours.poll(0):
        replies.append(type(wire.recv(ours)).__name__)
    assert replies == (["BatchDone", "SamplesSkipped", "BatchDone", "BatchDone"] if skip
                       else ["BatchDone", "BatchFailed", "BatchDone"])
    assert mappings(memory.token + "ring0") == []  # before the fix: kept mapped for the worker's life
    assert segment_fds(memory.token + "ring0") == []  # and its descriptor closed: the memory can go
    assert rings.mapped() == [1]
    rings.close()
    ours.close()
    theirs.close()


def test_worker_rings_retry_unmapping_an_old_ring_still_in_use():
    from procpipe._core.rings import WorkerRings
    from procpipe._core.shm import PAGE

    memory = procpipe._core.shm.Segments()
    rings = WorkerRings()
    for ring_id, fd in enumerate(_ring_segments(memory, 2, PAGE)):
        rings.add(ring_id, fd, 2 * PAGE)
    view = rings.slot(0, 1, PAGE)
    rings.slot(1, 0, PAGE)
    assert mappings(memory.token + "ring0")  # still exported by ``view``: kept
    view.release()
    rings.slot(1, 1, PAGE)  # (before the fix: never tried again)
    assert mappings(memory.token + "ring0") == [] and rings.mapped() == [1]
    rings.close()


def test_stage_slots_give_the_ring_that_many_more_slots():
    def slots(**extra):
        with procpipe.Loader(range(64), image, batch_size=8, workers=2, **extra) as loader:
            next(iter(loader))
            return loader.stats()["ring_slots"]

    assert slots(stage_slots=3) == slots() + 3
    with pytest.raises(ValueError, match="stage_slots must be an int >= 0"):
        procpipe.Loader(range(8), image, stage_slots=-1)


def test_reserve_stage_slots_adds_spare_slots_before_or_after_the_ring_exists():
    """``Loader.reserve_stage_slots`` (procpipe.tf.dataset's ring views): counted in when the ring
    is made, or added to a ring that exists (a wider generation, batches keep flowing); the
    largest request counts, and it adds to ``stage_slots=``, which is for the caller's stages."""
    with procpipe.Loader(range(64), image, batch_size=8, workers=2) as plain:
        next(iter(plain))
        base = plain.stats()["ring_slots"]
    with procpipe.Loader(range(64), image, batch_size=8, workers=2, stage_slots=1) as before:
        before.reserve_stage_slots(4)
        before.reserve_stage_slots(2)  # (smaller: the 4 stay)
        assert sum(len(b) for b in before) == 64
        assert before.stats()["ring_slots"] == base + 1 + 4
    with procpipe.Loader(range(64), image, batch_size=8, workers=2) as after:
        assert sum(len(b) for b in after) == 64  # the ring exists
        after.reserve_stage_slots(3)
        assert sum(len(b) for b in after) == 64
        stats = after.stats()
        assert stats["ring_slots"] == base + 3 and stats["overflow_batches"] == 0
    with procpipe.Loader(range(8), image, batch_size=8, workers=0) as inline:
        inline.reserve_stage_slots(4)  # no ring: nothing to do
        assert len(list(inline)) == 1
    with pytest.raises(ValueError, match="slots must be an int >= 0, got -1"):
        plain.reserve_stage_slots(-1)
