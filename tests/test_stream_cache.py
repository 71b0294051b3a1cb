"""``cache=...`` for a stream without record counts (``Shards`` without ``lengths``): the
growing cache of _worker/stream_cache.py. Epoch 0 reads and runs ``fn`` once per record,
storing each output as it arrives; later epochs open no shard and run no ``fn``."""
from __future__ import annotations

import collections
import glob
import os
import signal
import time

import numpy as np
import pytest
from faultkit import first_attempt

from procpipe import CacheError, Loader, Shards

# (shard id, records): uneven, empty, shorter than a block, exact multiples of the block.
SHARDS = [(0, 5), (1, 0), (2, 13), (3, 8), (4, 3), (5, 16), (6, 1)]
RECORDS = sorted(s * 1000 + i for s, n in SHARDS for i in range(n))


def log(log_dir, what, line="x"):
    with open(os.path.join(log_dir, what), "a") as f:
        f.write(f"{line}\n")


def computed_per_record(log_dir):
    """How many times ``fn`` ran on each record."""
    with open(os.path.join(log_dir, "fn")) as f:
        return collections.Counter(int(line) for line in f.read().split())


def calls(log_dir, what):
    path = os.path.join(log_dir, what)
    return len(open(path).read().split()) if os.path.exists(path) else 0


class Counted:
    """``open_fn`` and ``fn`` that log each call to a file (from any process); ``fn`` kills its
    worker on the first attempt at the records in ``kill`` (a marker file in ``log_dir``)."""

    def __init__(self, log_dir, kill=(), stall=None):
        self.log_dir, self.kill, self.stall = str(log_dir), set(kill), stall

    def open_fn(self, shard):
        log(self.log_dir, "open")
        for i in range(shard[1]):
            yield shard[0] * 1000 + i

    def fn(self, record):
        log(self.log_dir, "fn", record)  # (which record: computed_per_record)
        if record in self.kill and first_attempt(self.log_dir, f"kill-{record}"):
            os.kill(os.getpid(), signal.SIGKILL)
        if record == self.stall and first_attempt(self.log_dir, "stalled"):  # until the test lets it go on
            deadline = time.monotonic() + 60  # (a broken speculation fails the test, not hangs it)
            while not os.path.exists(os.path.join(self.log_dir, "go")) and time.monotonic() < deadline:
                time.sleep(0.005)
        return {"x": np.array([record, record * 2], np.int64), "y": float(record) / 2}


def values(batches):
    return [b["x"].tolist() for b in batches]


def make(counted, workers, cache, **kwargs):
    source = Shards(SHARDS, counted.open_fn, cycle_length=3, block_length=4)
    return Loader(source, counted.fn, batch_size=5, workers=workers, shuffle=True, reshuffle=False, seed=2,
                  cache=cache, **kwargs)


def private_dir(path):
    os.makedirs(path, mode=0o700)
    return str(path)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("where", ["memory", "directory"])
def test_growing_cache_runs_fn_once_per_record_then_never(tmp_path, workers, where):
    logs = private_dir(tmp_path / "logs")
    cache = "memory" if where == "memory" else private_dir(tmp_path / "cache")
    counted = Counted(logs)
    with make(counted, workers, cache) as loader:
        epochs = [values(loader)]
        assert calls(logs, "fn") == len(RECORDS)  # (the first record's, computed to lay the cache out, is stored)
        opens = calls(logs, "open")
        epochs += [values(loader), values(loader)]
        assert calls(logs, "fn") == len(RECORDS)  # epochs 1-2: no fn,
        assert calls(logs, "open") == opens  # and no shard opened (the shards' ends are in the cache)
        info = loader.cache_info()
        assert (info["samples"], info["filled"], info["error"]) == (len(RECORDS), len(RECORDS), None)
    assert epochs[0] == epochs[1] == epochs[2]
    assert sorted(x for x, _ in (r for b in epochs[0] for r in b)) == RECORDS
    with make(Counted(logs), 0, None) as loader:  # the very batches of the loader without a cache
        assert values(loader) == epochs[0]
    if where == "directory":
        assert os.listdir(cache) == []  # removed with the loader


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("take", [7, 13])  # mid-epoch 0, mid-epoch 1 (an epoch has 10 batches)
def test_growing_cache_resumes_exactly(tmp_path, workers, take):
    counted = Counted(private_dir(tmp_path / "logs"))
    with make(counted, workers, True, epochs=2) as loader:
        full = values(loader)
    with make(counted, workers, True, epochs=2) as loader:
        it = iter(loader)
        taken = values(next(it) for _ in range(take))
        state = loader.state_dict()
    with make(counted, workers, True, epochs=2) as loader:
        loader.load_state_dict(state)
        rest = values(loader)
    assert taken + rest == full


@pytest.mark.parametrize("workers", [0, 2])
def test_growing_cache_after_an_epoch_broken_off(tmp_path, workers):
    """An epoch left midway stores what it read; the next epoch reads the rest (and ends the shards)."""
    logs = private_dir(tmp_path / "logs")
    # Workers run ahead of the consumer, as far as the ring lets them: record 6000, the only
    # one of shard 6 and of the last batch, is held back until the test lets it go on, so
    # that shard's end is not seen before the break however far ahead they got.
    with make(Counted(logs, stall=6000), workers, True) as loader:
        taken = []
        for i, batch in enumerate(loader):
            taken += values([batch])
            if i == 3:
                break
        assert loader.cache_info()["samples"] is None  # (not every shard's end seen yet)
        open(os.path.join(logs, "go"), "w").close()  # (the stalled record goes on)
        whole = values(loader)
        assert whole[:4] == taken
        runs = computed_per_record(logs)
        assert sorted(runs) == RECORDS  # every record's fn ran,
        assert all(runs[x] == 1 for b in taken for x, _ in b)  # those delivered before the break once
        if workers == 0:
            assert sum(runs.values()) == len(RECORDS)  # (nothing else was under way at the break)
        # (with workers, a record whose batch was under way when the epoch was broken off may
        # also run in the next epoch, before the first run stored it)
        computed = calls(logs, "fn")
        assert values(loader) == whole and calls(logs, "fn") == computed  # the cache is whole: no fn
        assert loader.cache_info()["samples"] == len(RECORDS)
    with make(Counted(logs), 0, None) as loader:
        assert values(loader) == whole


@pytest.mark.parametrize("where", ["memory", "directory"])
def test_growing_cache_survives_a_worker_killed_in_epoch_0(tmp_path, where):
    logs = private_dir(tmp_path / "logs")
    cache = "memory" if where == "memory" else private_dir(tmp_path / "cache")
    counted = Counted(logs, kill={2005, 5009})
    with make(counted, 2, cache) as loader:
        first = values(loader)
        assert calls(logs, "fn") >= len(RECORDS)  # (the records of a killed block ran again)
        assert os.path.exists(os.path.join(logs, "kill-2005")) and os.path.exists(os.path.join(logs, "kill-5009"))
        computed = calls(logs, "fn")
        second = values(loader)
        assert calls(logs, "fn") == computed
        assert loader.cache_info()["filled"] == len(RECORDS)
    assert first == second
    with make(Counted(logs), 0, None) as loader:
        assert values(loader) == first  # exactly once, in order


def test_growing_cache_with_a_block_run_twice_by_speculation(tmp_path):
    """A stalled block is raced by a speculative copy; the stalled attempt then stores the same
    records again while the next epoch reads them (concurrent writers of one shard)."""
    logs = private_dir(tmp_path / "logs")
    with make(Counted(logs, stall=2005), 2, True, speculate=2.0) as loader:
        first = values(loader)  # (the speculative attempt delivers block 1 of shard 2)
        assert os.path.exists(os.path.join(logs, "stalled")) and not os.path.exists(os.path.join(logs, "go"))
        open(os.path.join(logs, "go"), "w").close()
        second, third = values(loader), values(loader)
        assert loader.cache_info()["filled"] == len(RECORDS)
    assert first == second == third
    with make(Counted(logs), 0, None) as loader:
        assert values(loader) == first


def cache_fd(cache):
    """``workers=0`` removes the file's name at once: this process's descriptor of it."""
    fds = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
    return [fd for fd in fds if os.path.islink(fd) and os.readlink(fd).startswith(cache + "/procpipe-")]


@pytest.mark.parametrize("workers", [0, 2])
def test_growing_cache_detects_changed_bytes(tmp_path, workers):
    cache = private_dir(tmp_path / "cache")
    with make(Counted(private_dir(tmp_path / "logs")), workers, cache) as loader:
        values(loader)
        (path,) = glob.glob(os.path.join(cache, "procpipe-*cache")) or cache_fd(cache)
        with open(path, "r+b") as f:  # a byte of the first chunk's first record (after the shard table)
            f.seek(4096 + 64 + 8)
            byte = f.read(1)
            f.seek(4096 + 64 + 8)
            f.write(bytes([byte[0] ^ 0xFF]))
        info = loader.cache_info()
        assert info["error"] is None and info["filled"] == len(RECORDS)  # (the checksums are checked on reads)
        with pytest.raises(CacheError, match=r"corrupt.*checksum"):
            values(loader)
        with open(path, "r+b") as f:
            f.truncate(os.fstat(f.fileno()).st_size - 100)
        info = loader.cache_info()
        assert info["filled"] is None and "truncated or changed" in info["error"]


def _varying_record(record):
    return {"x": np.zeros(3 if record < 2 else 4, np.float32), "y": 1}


def _open_records(shard):
    yield from range(shard * 3, shard * 3 + 3)


def test_a_record_that_does_not_match_the_first_is_refused_as_the_indexed_cache_refuses_a_sample():
    """The growing cache matches each record against the first one's layout (cache_file.py's ``Layout``,
    shared with the indexed cache): the error names the record, the leaf, both shapes and the fix."""
    with Loader(Shards([0], _open_records), _varying_record, batch_size=3, workers=0, cache=True) as loader:
        with pytest.raises(CacheError) as info:
            list(loader)
    message = str(info.value)
    assert "sample['x'] of record (shard 0, record 2) is an array of shape (4,) and dtype float32" in message, message
    assert "laid out from the first record, where it is an array of shape (3,) and dtype float32" in message
    assert "Every record's fn output must have the same structure" in message and "cache=False" in message
