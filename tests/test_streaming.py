"""Streaming sources (procpipe.Shards): tf.data's interleave order, exactly-once delivery in both
orders, batching across blocks, the shuffle buffer, slow shards, errors, worker deaths."""
from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest
from conftest import is_ring_view

import procpipe
from procpipe import Loader, Shards
from procpipe._sources.stream import Interleave

# (shard id, records): uneven, empty, shorter than a block, exact multiples of 4 and of 3.
SHARDS = [(0, 5), (1, 0), (2, 13), (3, 8), (4, 3), (5, 16), (6, 1), (7, 12), (8, 9)]
ALL = sorted(sid * 1000 + i for sid, n in SHARDS for i in range(n))


def record_id(shard, i):
    return shard[0] * 1000 + i


def open_shard(shard):
    """A shard's records: dicts with an array, a number and a string (default collation covers all)."""
    for i in range(shard[1]):
        rid = record_id(shard, i)
        yield {"id": np.array([rid, -rid], np.int64), "w": rid / 2, "name": f"r{rid}"}


def reference_interleave(shards, cycle_length, block_length):
    """Record ids in tf.data's order: InterleaveDatasetOp's GetNext loop, record by record."""
    inputs = iter([iter([record_id(s, i) for i in range(s[1])]) for s in shards])
    cycle = [None] * cycle_length
    index = block_index = num_open = 0
    end_of_input = False
    out = []
    while not end_of_input or num_open > 0:
        if cycle[index] is not None:
            try:
                out.append(next(cycle[index]))
            except StopIteration:  # the element ended: free its slot, on to the next one
                cycle[index] = None
                num_open -= 1
                index, block_index = (index + 1) % cycle_length, 0
                continue
            block_index += 1
            if block_index == block_length:
                index, block_index = (index + 1) % cycle_length, 0
        elif not end_of_input:  # an empty slot: open the next input element there
            try:
                cycle[index] = next(inputs)
                num_open += 1
            except StopIteration:
                end_of_input = True
        else:
            index, block_index = (index + 1) % cycle_length, 0
    return out


def ids(batches):
    return [int(v) for b in batches for v in b["id"][:, 0]]


def load(shards=SHARDS, cycle_length=3, block_length=4, open_fn=open_shard, fn=None, **kwargs):
    kwargs.setdefault("batch_size", 5)
    with Loader(Shards(shards, open_fn, cycle_length=cycle_length, block_length=block_length), fn, **kwargs) as loader:
        return list(loader)


# --------------------------------------------------------------------------- the order
def test_interleave_replays_tf_data_order_for_random_lengths():
    rng = random.Random(0)
    for _ in range(300):
        shards = [(sid, rng.choice([0, 1, 2, 3, 4, 5, 8, 11])) for sid in range(rng.randint(0, 9))]
        cycle, block = rng.randint(1, 5), rng.randint(1, 4)
        interleave, got = Interleave(len(shards), cycle, block), []
        while (key := interleave.awaited()) is not None:
            position, b = key
            n = shards[position][1]
            count = max(0, min(block, n - b * block))
            got += [record_id(shards[position], b * block + i) for i in range(count)]
            interleave.advance(count)
        assert got == reference_interleave(shards, cycle, block), (shards, cycle, block)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cycle_length, block_length, batch_size", [(1, 1, 3), (2, 4, 4), (3, 4, 5), (4, 3, 7), (12, 2, 2)])
def test_ordered_is_tf_data_interleave(workers, cycle_length, block_length, batch_size):
    got = load(cycle_length=cycle_length, block_length=block_length, batch_size=batch_size, workers=workers)
    assert ids(got) == reference_interleave(SHARDS, cycle_length, block_length)
    sizes = [len(b["name"]) for b in got]
    assert sizes[:-1] == [batch_size] * (len(sizes) - 1) and 0 < sizes[-1] <= batch_size  # batching as usual
    for b in got:
        assert b["name"] == [f"r{i}" for i in b["id"][:, 0]] and b["w"].dtype == np.float64
        np.testing.assert_array_equal(b["id"][:, 1], -b["id"][:, 0])


@pytest.mark.parametrize("cycle_length, block_length, workers", [(1, 3, 2), (3, 4, 2), (4, 2, 3), (9, 5, 2)])
def test_sloppy_delivers_every_record_once(cycle_length, block_length, workers):
    got = load(cycle_length=cycle_length, block_length=block_length, workers=workers, ordered=False)
    assert sorted(ids(got)) == ALL


def test_ordered_output_does_not_depend_on_workers():
    def run(workers):
        return load(fn=noisy, workers=workers, shuffle=True, seed=7, cycle_length=3, block_length=3, batch_size=4)

    runs = [run(w) for w in (0, 1, 3)]
    for other in runs[1:]:
        assert ids(other) == ids(runs[0])
        for a, b in zip(runs[0], other, strict=True):
            np.testing.assert_array_equal(a["noise"], b["noise"])
    shard_order = procpipe._sources.stream.ShardOrder(
        Shards(SHARDS, open_shard), batch_size=4, shuffle=True, seed=7, drop_last=False).batches(0)
    assert ids(runs[0]) == reference_interleave([SHARDS[i] for i in shard_order], 3, 3)


def noisy(record):
    """fn with per-record randomness: seeded from (seed, epoch, shard, record)."""
    return {"id": record["id"], "noise": procpipe.sample_rng().integers(0, 1 << 30, 2)}


def test_epochs_reshuffle_shards_and_each_reads_every_record_once():
    with Loader(Shards(SHARDS, open_shard, cycle_length=2, block_length=4), batch_size=6, workers=2, shuffle=True,
                epochs=3, with_epoch=True) as loader:
        got = list(loader)
    per_epoch = {e: ids([b for n, b in got if n == e]) for e in range(3)}
    assert [n for n, _ in got] == sorted(n for n, _ in got)
    for e, records in per_epoch.items():
        assert sorted(records) == ALL, e
    assert per_epoch[0] != per_epoch[1]


# --------------------------------------------------------------------------- batching
@pytest.mark.parametrize("batch_size", [4, 3])
def test_a_batch_inside_one_block_is_a_zero_copy_view_and_others_are_joined(batch_size):
    shards = [(0, 8), (1, 8), (2, 5)]  # blocks of 4
    with Loader(Shards(shards, open_shard, cycle_length=2, block_length=4), batch_size=batch_size, workers=2,
                epochs=2, with_epoch=True) as loader:
        got = [b for epoch, b in loader if epoch == 1]  # epoch 0 sized the ring (its first blocks came inline)
    assert ids(got) == reference_interleave(shards, 2, 4)
    if batch_size == 4:  # batches aligned with blocks until the short shard: each is one block, in its slot
        assert all(is_ring_view(b["id"]) for b in got[:4])
    else:  # records 0-2 lie in block 0; records 3-5 span blocks 0 and 1: joined, a copy
        assert is_ring_view(got[0]["id"]) and not is_ring_view(got[1]["id"])


def test_drop_last_drops_only_the_last_partial_batch():
    got = load(batch_size=5, workers=2, drop_last=True)
    assert [len(b["name"]) for b in got] == [5] * (len(ALL) // 5)
    assert ids(got) == reference_interleave(SHARDS, 3, 4)[:len(ALL) // 5 * 5]


def pad_collate(records):
    return np.stack([r["id"] for r in records])


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_fn_batches_never_span_blocks(workers):
    got = load(collate_fn=pad_collate, batch_size=3, block_length=4, workers=workers)
    order = reference_interleave(SHARDS, 3, 4)
    assert [int(v) for b in got for v in b[:, 0]] == order
    assert all(len(b) <= 3 for b in got) and any(len(b) == 1 for b in got)  # a block of 4 = batches of 3 + 1
    got = load(collate_fn=pad_collate, batch_size=3, block_length=6, workers=workers, drop_last=True)
    assert all(len(b) == 3 for b in got)


def test_unbatched_records():
    got = load(batch_size=None, workers=2, ordered=False)
    assert sorted(int(r["id"][0]) for r in got) == ALL
    assert isinstance(got[0]["w"], float) and isinstance(got[0]["name"], str)


# --------------------------------------------------------------------------- batch_fn
def summarize(batch):
    """A batch_fn that builds a new batch (ids, doubled weights, one string, its size)."""
    return {"id": batch["id"], "w2": batch["w"] * 2, "names": "|".join(batch["name"]), "n": len(batch["name"])}


def as_plain(batch):
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in batch.items()}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ordered", [True, False])
def test_batch_fn_gives_what_applying_it_to_the_batches_would_give(workers, ordered):
    aligned = [(0, 8), (1, 12), (2, 0), (3, 4), (4, 16)]  # every shard a whole number of blocks of 4
    kwargs = dict(shards=aligned, cycle_length=2, block_length=4, batch_size=4, workers=workers, ordered=ordered)
    plain = [as_plain(summarize(b)) for b in load(**kwargs)]
    got = [as_plain(b) for b in load(batch_fn=summarize, **kwargs)]
    if ordered:
        assert got == plain
    else:
        assert sorted(got, key=lambda b: b["id"]) == sorted(plain, key=lambda b: b["id"])
    assert all(b["n"] == 4 for b in got)


@pytest.mark.parametrize("workers", [0, 2])
def test_with_batch_fn_batches_never_span_blocks(workers):
    got = load(batch_fn=summarize, block_length=4, batch_size=3, workers=workers)
    assert [i for b in got for i in ids([b])] == reference_interleave(SHARDS, 3, 4)
    for b in got:  # each batch lies in one block: one shard, one block of 4 records
        rids = b["id"][:, 0]
        assert len({(r // 1000, r % 1000 // 4) for r in rids}) == 1 and 1 <= b["n"] <= 3
    assert sorted({b["n"] for b in got}) == [1, 3]  # a block of 4 = batches of 3 + 1; short last blocks of 1 or 3
    dropped = load(batch_fn=summarize, block_length=4, batch_size=3, workers=workers, drop_last=True)
    assert [b["n"] for b in dropped] == [3] * len(dropped) and len(dropped) == sum(b["n"] == 3 for b in got)


def draw_per_batch(batch):
    """batch_fn with batch-level randomness: one draw from batch_rng() per batch."""
    return {"id": batch["id"], "draw": procpipe.batch_rng().integers(0, 1 << 40, 1)}


def first_and_draw(batches):
    return [(int(b["id"][0, 0]), int(b["draw"][0])) for b in batches]


def test_batch_rng_is_seeded_by_the_first_record_of_the_batch_whatever_the_workers():
    def run(workers, batch_size=4, seed=5, epochs=1):
        with Loader(Shards(SHARDS, open_shard, cycle_length=3, block_length=4), batch_size=batch_size,
                    workers=workers, seed=seed, shuffle=True, batch_fn=draw_per_batch, epochs=epochs,
                    with_epoch=True) as loader:
            got = list(loader)
        return [first_and_draw([b for n, b in got if n == e]) for e in range(epochs)]

    reference = run(0, epochs=2)
    assert run(1, epochs=2) == reference and run(2, epochs=2) == reference  # ordered: the same for any workers
    first, second = reference
    assert len({d for _, d in first}) == len(first)  # one draw per batch, all different
    assert dict(first).keys() == dict(second).keys()  # the same batches (blocks), in another shard order...
    assert all(dict(second)[r] != d for r, d in first)  # ...with other draws: the epoch matters
    assert dict(first) != dict(run(0, seed=6)[0])  # the seed matters
    # Halving the batch size cuts each block in two: the halves that start where the whole
    # block starts begin with the same record, and get the same draws.
    halves = dict(run(2, batch_size=2)[0])
    assert all(halves[r] == d for r, d in first)


def sample_rng_in_batch_fn(batch):
    procpipe.sample_rng()
    return batch


def fail_on_record(batch):
    if 2006 in batch["id"][:, 0]:
        raise ZeroDivisionError("bad batch")
    return batch


@pytest.mark.parametrize("workers", [0, 2])
def test_batch_fn_errors_name_the_shard_and_records(workers):
    with pytest.raises(ZeroDivisionError, match="bad batch") as info:
        load(batch_fn=fail_on_record, block_length=4, batch_size=4, workers=workers)
    assert any("raised by batch_fn on the batch of records 4-7 of shard 2 ((2, 13)) (epoch 0)" in note
               for note in info.value.__notes__), info.value.__notes__
    with pytest.raises(RuntimeError, match="use procpipe.batch_rng"):
        load(batch_fn=sample_rng_in_batch_fn, workers=workers)


def test_batch_fn_with_a_shuffle_buffer_is_refused():
    with pytest.raises(ValueError, match="batch_fn together with shuffle_buffer"):
        Loader(Shards(SHARDS, open_shard), batch_size=4, workers=0, shuffle_buffer=10, batch_fn=summarize)


# --------------------------------------------------------------------------- shuffle buffer
@pytest.mark.parametrize("buffer", [1, 7, 100])
def test_shuffle_buffer_keeps_exactly_once_and_is_deterministic(buffer):
    first = ids(load(shuffle_buffer=buffer, seed=3, workers=2, batch_size=4))
    assert sorted(first) == ALL
    assert ids(load(shuffle_buffer=buffer, seed=3, workers=0, batch_size=4)) == first
    unshuffled = reference_interleave(SHARDS, 3, 4)
    if buffer == 1:
        assert first == unshuffled  # a buffer of one record shuffles nothing
    else:
        assert first != unshuffled
        assert ids(load(shuffle_buffer=buffer, seed=4, workers=2, batch_size=4)) != first


def test_shuffle_buffer_is_bounded_and_works_unbatched_and_with_collate_fn():
    order = reference_interleave(SHARDS, 3, 4)
    got = [int(r["id"][0]) for r in load(shuffle_buffer=5, batch_size=None, workers=2)]
    assert sorted(got) == ALL
    for k, rid in enumerate(got[:-5]):  # a buffer of 5: record k comes out before record k+5 goes in
        assert order.index(rid) <= k + 5
    got = load(shuffle_buffer=5, batch_size=4, workers=2, collate_fn=pad_collate)
    assert sorted(int(v) for b in got for v in b[:, 0]) == ALL
    assert [len(b) for b in got][:-1] == [4] * (len(got) - 1)


# --------------------------------------------------------------------------- slow shards
def gated_open(shard):
    """Shard ("slow", n, gate) waits until the file ``gate`` exists: a read that stalls."""
    name, n, gate = shard
    if gate is not None:
        while not os.path.exists(gate):
            time.sleep(0.005)  # the stalled I/O itself, not synchronization of the test
    for i in range(n):
        yield f"{name}-{i}"


@pytest.mark.parametrize("batch_size", [None, 3])
def test_a_slow_shard_does_not_hold_back_the_others_when_sloppy(tmp_path, batch_size):
    gate = str(tmp_path / "gate")
    shards = [("slow", 6, gate)] + [(f"fast{k}", 6, None) for k in range(5)]
    fast = 5 * 6 if batch_size is None else 5 * 6 // batch_size
    source = Shards(shards, gated_open, cycle_length=2, block_length=3)
    safety = threading.Timer(60, lambda: open(gate, "w").close())  # only so that a failure cannot hang
    safety.start()
    try:
        with Loader(source, batch_size=batch_size, workers=2, ordered=False,
                    collate_fn=None if batch_size is None else list) as loader:
            it = iter(loader)
            before = [next(it) for _ in range(fast)]  # everything of the fast shards, the slow one stalled
            released = not os.path.exists(gate)
            open(gate, "w").close()
            after = list(it)
    finally:
        safety.cancel()

    def flat(items):
        return [r for x in items for r in ([x] if batch_size is None else x)]

    assert released, "the slow shard was released by the safety timer: fast shards waited for it"
    assert sorted(flat(before)) == sorted(f"fast{k}-{i}" for k in range(5) for i in range(6))
    assert flat(after) == [f"slow-{i}" for i in range(6)]


# --------------------------------------------------------------------------- errors
def open_failing(shard):
    if shard[0] == 3:
        raise KeyError(f"cannot open shard {shard}")
    return open_shard(shard)


def open_breaking(shard):
    for k, record in enumerate(open_shard(shard)):
        if shard[0] == 5 and k == 9:
            raise OSError("disk read failed")
        yield record


def fn_failing(record):
    if record["name"] == "r2006":
        raise ValueError("bad record")
    return record


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ordered", [True, False])
def test_errors_keep_their_type_and_name_the_shard(workers, ordered):
    with pytest.raises(KeyError) as info:
        load(open_fn=open_failing, workers=workers, ordered=ordered)
    assert any("open_fn opening shard 3 ((3, 8))" in note for note in info.value.__notes__)
    with pytest.raises(OSError, match="disk read failed") as info:
        load(open_fn=open_breaking, workers=workers, ordered=ordered)
    assert any("reading record 9 of shard 5 ((5, 16))" in note for note in info.value.__notes__)
    with pytest.raises(ValueError, match="bad record") as info:
        load(fn=fn_failing, workers=workers, ordered=ordered)
    assert any("fn on record 6 of shard 2 ((2, 13))" in note for note in info.value.__notes__)


def fn_shape_by_shard(record):
    rid = int(record["id"][0])
    return {"id": record["id"], "x": np.zeros(1 + (rid >= 2000), np.float32)}


def test_records_that_cannot_share_a_batch_raise_collate_error():
    with pytest.raises(procpipe.CollateError, match="across two blocks"):
        load(shards=[(0, 3), (2, 3)], fn=fn_shape_by_shard, cycle_length=2, block_length=2, batch_size=4, workers=2)


def test_ordered_failure_comes_after_the_records_before_it():
    got = []
    with (Loader(Shards(SHARDS, open_shard, cycle_length=3, block_length=4), fn_failing, batch_size=1,
                 workers=2) as loader, pytest.raises(ValueError)):
        for batch in loader:
            got.append(int(batch["id"][0, 0]))
    order = reference_interleave(SHARDS, 3, 4)
    assert got == order[:order.index(2004)]  # every block before the failing one (records 2004-2007)


def test_unsupported_options_are_refused_clearly():
    source = Shards(SHARDS, open_shard)
    with Loader(source, workers=0) as loader:
        with pytest.raises(TypeError, match="no len"):
            len(loader)
    # (speculate, on_error="skip", cache and len() with lengths: test_stream_features.py;
    # cache without lengths: test_stream_cache.py)
    for kwargs in ({"batches": lambda e: [[0]]},):
        with pytest.raises(ValueError, match="streaming source"):
            Loader(source, workers=0, **kwargs)
    with pytest.raises(ValueError, match="shuffle_buffer"):
        Loader(list(range(4)), workers=0, shuffle_buffer=3)
    for bad in ({"cycle_length": 0}, {"block_length": 1.5}):
        with pytest.raises(ValueError):
            Shards(SHARDS, open_shard, **bad)
    with pytest.raises(TypeError, match="single str"):
        Shards("sentences.txt", open)


# --------------------------------------------------------------------------- faults, lifecycle
class OnceAt:
    """fn that misbehaves (``act``) on one record, the first time only (a marker file remembers)."""

    def __init__(self, marker, at):
        self.marker, self.at = marker, at

    def __call__(self, record):
        if record["name"] == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            self.act()
        return record


class DieOnce(OnceAt):
    """Kills its worker."""

    def act(self):
        os._exit(3)


@pytest.mark.parametrize("ordered", [True, False])
def test_worker_death_reopens_the_shard_and_skips_what_was_read(tmp_path, ordered):
    with Loader(Shards(SHARDS, open_shard, cycle_length=3, block_length=4), DieOnce(str(tmp_path / "m"), "r5009"),
                batch_size=5, workers=2, ordered=ordered) as loader:
        got = ids(loader)
        stats = loader.stats()
    assert stats["worker_deaths"] == 1 and stats["redispatched_tasks"] >= 1
    order = reference_interleave(SHARDS, 3, 4)
    assert got == order if ordered else sorted(got) == ALL


class HangOnce(OnceAt):
    """Hangs: task_timeout kills the worker."""

    def act(self):
        threading.Event().wait(120)  # a hung read; the worker is killed long before


def test_task_timeout_kills_a_stuck_reader_and_the_shard_is_read_again(tmp_path):
    with Loader(Shards(SHARDS, open_shard, cycle_length=3, block_length=4), HangOnce(str(tmp_path / "m"), "r7005"),
                batch_size=5, workers=2, task_timeout=1.0) as loader:
        got = ids(loader)
        stats = loader.stats()
    assert got == reference_interleave(SHARDS, 3, 4)
    assert stats["timed_out_tasks"] == 1 and stats["redispatched_tasks"] >= 1


def test_breaking_off_an_epoch_then_iterating_again():
    with Loader(Shards(SHARDS, open_shard, cycle_length=3, block_length=4), batch_size=5, workers=2) as loader:
        for k, _ in enumerate(loader):
            if k == 2:
                break
        assert ids(loader) == reference_interleave(SHARDS, 3, 4)
        assert loader.stats()["samples"] == len(ALL)
    with Loader(Shards(SHARDS, open_shard, cycle_length=3, block_length=4), batch_size=5, workers=0) as loader:
        next(iter(loader))
        assert ids(loader) == reference_interleave(SHARDS, 3, 4)


def read_lines(path):
    with open(path) as f:
        for line in f:
            yield line.rstrip("\n")


def test_text_files_as_shards(tmp_path):
    paths = []
    for k, n in enumerate([7, 0, 12, 5]):
        path = tmp_path / f"part-{k}.txt"
        path.write_text("".join(f"{k}:{i}\n" for i in range(n)))
        paths.append(str(path))
    with Loader(Shards(paths, read_lines, cycle_length=2, block_length=3), str.upper, batch_size=4,
                workers=2) as loader:
        lines = [x for batch in loader for x in batch]
    assert sorted(lines) == sorted(f"{k}:{i}" for k, n in enumerate([7, 0, 12, 5]) for i in range(n))
    # Blocks of 3; part-1 is empty: its turn yields nothing, and part-2 takes its place next round.
    assert lines[:9] == ["0:0", "0:1", "0:2", "0:3", "0:4", "0:5", "2:0", "2:1", "2:2"]
