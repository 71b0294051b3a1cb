"""Features of indexed sources made to work for streaming sources (procpipe.Shards):
``len()`` from ``Shards(lengths=...)``, a promise the epoch enforces, ``cache=...`` keyed by
``(shard, record)``, ``on_error="skip"`` counting records, and ``speculate``."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import procpipe
from procpipe import Loader, ShardLengthError, Shards

# (shard id, records): uneven, empty, shorter than a block, exact multiples of the block.
SHARDS = [(0, 5), (1, 0), (2, 13), (3, 8), (4, 3), (5, 16), (6, 1)]
LENGTHS = [n for _, n in SHARDS]


def open_shard(shard):
    for i in range(shard[1]):
        yield shard[0] * 1000 + i


def open_liar(shard):
    """Shard 2 yields one record fewer than SHARDS says, shard 5 one more (by the shard's value)."""
    sid, n = shard
    yield from open_shard((sid, n - 1 if sid == 2 else n + 1 if sid == 5 else n))


def as_list(batch):
    return [batch] if isinstance(batch, int) else [int(x) for x in batch]


CASES = [
    dict(batch_size=5),
    dict(batch_size=5, drop_last=True),
    dict(batch_size=3, collate_fn=lambda records: list(records)),  # batches never span blocks
    dict(batch_size=3, collate_fn=lambda records: list(records), drop_last=True),
    dict(batch_size=None),
    dict(batch_size=4, shuffle_buffer=7),
    dict(batch_size=4, shuffle_buffer=7, drop_last=True),
    dict(batch_size=5, shuffle=True, shard=(1, 3), reshuffle=False),
]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_len_from_lengths_is_the_number_of_batches(workers, case):
    kwargs = dict(CASES[case])
    source = Shards(SHARDS, open_shard, cycle_length=3, block_length=4, lengths=LENGTHS)
    with Loader(source, workers=workers, seed=3, **kwargs) as loader:
        n = len(loader)
        batches = list(loader)
        assert len(batches) == n, kwargs
        again = list(loader)  # a second epoch: the same count
        assert len(again) == n
    if "shard" not in kwargs and not kwargs.get("drop_last"):
        records = sorted(r for b in batches for r in as_list(b))
        assert records == sorted(s * 1000 + i for s, k in SHARDS for i in range(k))


def test_no_lengths_no_len():
    with Loader(Shards(SHARDS, open_shard), batch_size=4, workers=0) as loader:
        with pytest.raises(TypeError, match="lengths="):
            len(loader)


def test_len_refused_when_a_rank_gets_other_shards_each_epoch():
    source = Shards(SHARDS, open_shard, lengths=LENGTHS)
    with Loader(source, batch_size=4, workers=0, shuffle=True, shard=(0, 2)) as loader:
        with pytest.raises(TypeError, match="different set of shards"):
            len(loader)
    equal = Shards([(i, 4) for i in range(6)], open_shard, lengths=[4] * 6)  # same lengths: same count
    with Loader(equal, batch_size=3, workers=0, shuffle=True, shard=(0, 2)) as loader:
        assert len(loader) == len(list(loader)) == 4


@pytest.mark.parametrize("lengths, error, match", [
    ([1, 2], ValueError, "one record count per shard"),
    ([5, 0, 13, 8, 3, -1, 1], ValueError, r"lengths\[5\] must be an int >= 0"),
    ([5, 0, 13, 8, 3, 16, 1.0], ValueError, r"lengths\[6\]"),
    ([5, 0, 13, 8, 3, 16, True], ValueError, r"lengths\[6\]"),
    ("5013", TypeError, "list of ints"),
    (7, TypeError, "list of ints"),
])
def test_lengths_are_validated(lengths, error, match):
    with pytest.raises(error, match=match):
        Shards(SHARDS, open_shard, lengths=lengths)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("liar, match", [(2, r"shard 1 \(\(2, 13\)\) ended after 12 records.*promised 13"),
                                         (5, r"shard 1 \(\(5, 16\)\) yielded more than 16 records")])
def test_a_shard_breaking_its_length_raises(workers, ordered, liar, match):
    shards = [(s, n) for s, n in SHARDS if s in (0, liar)]
    source = Shards(shards, open_liar, cycle_length=2, block_length=4, lengths=[n for _, n in shards])
    with Loader(source, batch_size=4, workers=workers, ordered=ordered) as loader:
        it = iter(loader)
        with pytest.raises(ShardLengthError, match=match):
            for _ in range(len(loader) + 2):
                next(it)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shorter_shard_on_a_block_boundary_raises(workers):
    """The shard ends exactly where a block ends (12 of 13 records, block 4): caught anyway."""
    source = Shards([(2, 13)], open_liar, cycle_length=1, block_length=4, lengths=[13])
    with Loader(source, batch_size=4, workers=workers) as loader:
        with pytest.raises(ShardLengthError, match="ended after 12"):
            list(loader)


# --------------------------------------------------------------------------- cache=...
def counting(log_dir):
    """open_fn and fn that log each call to a file (one line per call, from any process)."""
    def log(what):
        with open(os.path.join(log_dir, what), "a") as f:
            f.write("x\n")

    def open_fn(shard):
        log("open")
        for i in range(shard[1]):
            yield shard[0] * 1000 + i

    def fn(record):
        log("fn")
        return np.array([record, record * 2], np.int64)

    def calls(what):
        path = os.path.join(log_dir, what)
        return len(open(path).read().split()) if os.path.exists(path) else 0

    return open_fn, fn, calls


def noisy(sample):
    return sample + (procpipe.sample_rng().integers(1, 1000) << 32)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ordered", [True, False])
def test_cache_runs_fn_once_per_record_and_later_epochs_read_no_shard(tmp_path, workers, ordered):
    open_fn, fn, calls = counting(str(tmp_path))
    source = Shards(SHARDS, open_fn, cycle_length=3, block_length=4, lengths=LENGTHS)
    with Loader(source, fn, batch_size=5, workers=workers, ordered=ordered, shuffle=True, seed=2, cache=True,
                augment=noisy) as loader:
        first = [b.copy() for b in loader]
        fn_calls, opens = calls("fn"), calls("open")
        assert fn_calls == sum(LENGTHS)  # (the first record's, computed when the loader is created, is stored)
        second = [b.copy() for b in loader]
        assert calls("fn") == fn_calls and calls("open") == opens  # epoch 2: from the cache only
        assert loader.cache_info()["filled"] == sum(LENGTHS)
    for batches in (first, second):  # the cached stage is fn's output: the low half is the record
        records = sorted(int(r) for b in batches for r in b[:, 0] & 0xFFFFFFFF)
        assert records == sorted(s * 1000 + i for s, n in SHARDS for i in range(n))
    assert [b.tolist() for b in first] != [b.tolist() for b in second]  # augment still runs every epoch
    plain = Shards(SHARDS, open_shard, cycle_length=3, block_length=4)
    with Loader(plain, lambda r: np.array([r, r * 2], np.int64), batch_size=5, workers=0, shuffle=True, seed=2,
                augment=noisy, epochs=2) as loader:
        uncached = [b.tolist() for b in loader]
    if ordered:  # the very batches of the same loader without a cache, epoch for epoch
        assert [b.tolist() for b in first + second] == uncached


def test_cache_without_lengths_grows_as_records_arrive():
    """No refusal without ``lengths`` (test_stream_cache.py has the rest): the cache starts with the
    first record and learns the record count as the shards end."""
    with Loader(Shards(SHARDS, open_shard), batch_size=4, workers=0, cache=True) as loader:
        assert loader.cache_info()["filled"] == 1 and loader.cache_info()["samples"] is None
        records = sorted(int(r) for b in loader for r in b)
        assert records == sorted(s * 1000 + i for s, n in SHARDS for i in range(n))
        assert loader.cache_info()["filled"] == loader.cache_info()["samples"] == sum(LENGTHS)


@pytest.mark.parametrize("workers", [0, 2])
def test_cache_resumes_exactly(tmp_path, workers):
    open_fn, fn, _ = counting(str(tmp_path))

    def make():
        source = Shards(SHARDS, open_fn, cycle_length=3, block_length=4, lengths=LENGTHS)
        return Loader(source, fn, batch_size=3, workers=workers, epochs=2, cache=True)

    with make() as loader:
        full = [b.tolist() for b in loader]
    with make() as loader:
        it = iter(loader)
        taken = [next(it).tolist() for _ in range(len(loader) + 2)]  # into the second epoch
        state = loader.state_dict()
    with make() as loader:
        loader.load_state_dict(state)
        rest = [b.tolist() for b in loader]
    assert taken + rest == full


def test_cache_checks_the_lengths_while_filling():
    source = Shards([(0, 5), (2, 13)], open_liar, cycle_length=2, block_length=4, lengths=[5, 13])
    with Loader(source, batch_size=4, workers=0, cache=True) as loader:
        with pytest.raises(ShardLengthError, match="ended after 12"):
            list(loader)


# --------------------------------------------------------------------------- on_error="skip"
BAD = {(2, 3), (2, 4), (5, 15), (3, 0)}  # (shard id, record) whose fn raises


def fragile(record):
    if (record // 1000, record % 1000) in BAD:
        raise KeyError(f"bad record {record}")
    return record


def everything_but_bad():
    return sorted(s * 1000 + i for s, n in SHARDS for i in range(n) if (s, i) not in BAD)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("lengths, max_skipped", [(None, 4), (LENGTHS, 0.1)])
def test_skip_leaves_out_the_records_whose_fn_raises(workers, ordered, lengths, max_skipped):
    source = Shards(SHARDS, open_shard, cycle_length=3, block_length=4, lengths=lengths)
    with Loader(source, fragile, batch_size=3, workers=workers, ordered=ordered, on_error="skip",
                max_skipped=max_skipped) as loader:
        records = sorted(r for b in loader for r in as_list(b))
        skipped = loader.stats()["skipped"]
    assert records == everything_but_bad()
    assert sorted(map(tuple, skipped)) == sorted((SHARDS.index((s, n)), r) for s, r in BAD
                                                 for n in [dict(SHARDS)[s]])


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_budget_counts_records(workers):
    source = Shards(SHARDS, open_shard, cycle_length=3, block_length=4, lengths=LENGTHS)
    # 4 bad records of 46: max_skipped=0.05 allows ceil(2.3) = 3
    with Loader(source, fragile, batch_size=3, workers=workers, on_error="skip", max_skipped=0.05) as loader:
        with pytest.raises(KeyError, match="bad record") as info:
            list(loader)
    assert any("more than max_skipped allows (3)" in note for note in info.value.__notes__)


def broken_shard(shard):
    """Shard 5's iterator raises after 6 records: it cannot be read past that."""
    for i in range(shard[1]):
        if shard[0] == 5 and i == 6:
            raise OSError("disk on fire")
        yield shard[0] * 1000 + i


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_does_not_cut_a_shard_whose_iterator_fails(workers):
    source = Shards(SHARDS, broken_shard, cycle_length=3, block_length=4)
    with Loader(source, batch_size=3, workers=workers, on_error="skip", max_skipped=1000) as loader:
        with pytest.raises(OSError, match="disk on fire"):
            list(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_resumes_exactly(workers):
    def make():
        return Loader(Shards(SHARDS, open_shard, cycle_length=3, block_length=4), fragile, batch_size=3,
                      workers=workers, on_error="skip", max_skipped=10)

    with make() as loader:
        full = [as_list(b) for b in loader]
    with make() as loader:
        it = iter(loader)
        taken = [as_list(next(it)) for _ in range(6)]  # past (2, 3) and (2, 4)
        state = loader.state_dict()
    with make() as loader:
        loader.load_state_dict(state)
        rest = [as_list(b) for b in loader]
        assert [tuple(k) for k in loader.stats()["skipped"]] == [(5, 15)]  # not (2, 3) nor (2, 4) again
    assert taken + rest == full


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_with_cache_and_a_failing_augment(workers):
    def augment(sample):
        if sample % 1000 == 1:
            raise ValueError("no")
        return sample

    source = Shards(SHARDS, open_shard, cycle_length=3, block_length=4, lengths=LENGTHS)
    expected = sorted(s * 1000 + i for s, n in SHARDS for i in range(n) if i != 1)
    with Loader(source, lambda r: np.int64(r), batch_size=3, workers=workers, on_error="skip", max_skipped=10,
                cache=True, augment=augment, epochs=2) as loader:
        records = sorted(r for b in loader for r in as_list(b))
    assert records == sorted(expected * 2)


# --------------------------------------------------------------------------- speculate
def slow_once(marker_dir, record_id, seconds):
    """fn that sleeps ``seconds`` on ``record_id`` the first time any process runs it (a marker file)."""
    def fn(record):
        if record == record_id:
            try:
                os.close(os.open(os.path.join(marker_dir, "slow"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                time.sleep(seconds)
        time.sleep(0.002)
        return record
    return fn


@pytest.mark.parametrize("ordered", [True, False])
def test_speculation_races_a_straggling_block(tmp_path, ordered):
    shards = [(s, 24) for s in range(4)]
    expected = [as_list(b) for b in Loader(Shards(shards, open_shard, cycle_length=2, block_length=4),
                                           batch_size=4, workers=0)]
    source = Shards(shards, open_shard, cycle_length=2, block_length=4)
    with Loader(source, slow_once(str(tmp_path), 2009, 3.0), batch_size=4, workers=2, ordered=ordered,
                speculate=2.0, prefetch=1) as loader:
        got = [as_list(b) for b in loader]
        assert loader.stats()["speculative_tasks"] >= 1
        again = [as_list(b) for b in loader]  # the loser's late reply was discarded
    for batches in (got, again):
        if ordered:
            assert batches == expected
        else:
            assert sorted(r for b in batches for r in b) == sorted(r for b in expected for r in b)


def test_speculate_refused_for_shards_that_cannot_be_read_again():
    class OneShot(Shards):
        replayable = False

    with pytest.raises(ValueError, match="speculate with a OneShot source"):
        Loader(OneShot(SHARDS, open_shard), batch_size=4, workers=2, speculate=2.0)


def test_cache_layout_read_checks_the_first_shards_length():
    """The first record is read in the calling process to lay the cache out: an empty shard
    promised records raises there, naming it."""
    source = Shards([(0, 0), (1, 3)], open_shard, lengths=[2, 3])
    with pytest.raises(ShardLengthError, match=r"shard 0 \(\(0, 0\)\) ended after 0 records"):
        Loader(source, batch_size=2, workers=0, cache=True)


# --------------------------------------------------------------------------- device_fn's batch_rng, workers=0
def _shard_records(shard: list) -> list:
    return shard


# --------------------------------------------------------------------------- streams without lengths
def _fails_on_multiples(every: int):
    def fn(record: int) -> np.float32:
        if record % every == every - 1:
            raise ValueError(f"bad record {record}")
        return np.float32(record)
    return fn


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_skips_a_fraction_of_the_records_seen_so_far(workers: int) -> None:
    shards = [list(range(k * 50, k * 50 + 50)) for k in range(4)]  # no lengths=: the epoch's size is unknown
    with procpipe.Loader(procpipe.Shards(shards, _shard_records), fn=_fails_on_multiples(25), batch_size=5,
                         workers=workers, on_error="skip", max_skipped=0.05) as loader:
        got = sorted(r for batch in loader for r in batch.tolist())
        assert len(loader.stats()["skipped"]) == 8
    assert got == [r for r in range(200) if r % 25 != 24]
    with procpipe.Loader(procpipe.Shards(shards, _shard_records), fn=_fails_on_multiples(5), batch_size=5,
                         workers=workers, on_error="skip", max_skipped=0.05) as loader:
        with pytest.raises(ValueError, match="bad record") as raised:
            list(loader)
    assert "samples seen so far" in "\n".join(getattr(raised.value, "__notes__", []))
