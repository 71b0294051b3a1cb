"""Pipeline stages: ``batch_fn`` (vectorized, per batch) and ``cache`` + ``augment``.

Calls of user functions are counted across processes with ``Counted``: each call appends
one short line to a file (``O_APPEND`` writes of a few bytes are atomic), which the test
reads back. Values are compared with an in-process (``workers=0``), uncached reference;
they include ``sample_rng()``/``batch_rng()`` draws, so a stage that changed the
randomness (or ran on the wrong data) is caught.
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest
from conftest import is_ring_view, our_segments, our_shm_files, python_env, wait_gone, wait_until

from procpipe import CacheError, Loader, SharedMemoryError, batch_rng, sample_rng

N, BS = 40, 8  # 5 batches per epoch


class Counted:
    """Wraps a function; every call appends ``"<index>\\n"`` to ``path``."""

    def __init__(self, path, func):
        self.path, self.func = str(path), func

    def __call__(self, x):
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{_index_of(x)}\n".encode())
        finally:
            os.close(fd)
        return self.func(x)

    def counts(self):
        if not os.path.exists(self.path):
            return collections.Counter()
        with open(self.path) as f:
            return collections.Counter(int(line) for line in f.read().split())


def _index_of(x):
    if isinstance(x, dict):
        return int(x["i"][0]) if np.ndim(x["i"]) else int(x["i"])
    return int(np.asarray(x).ravel()[0])


# ------------------------------------------------------------------------ batch_fn
def vec(i):
    return {"i": i, "x": np.arange(4, dtype=np.float32) + i}


def scale(batch):
    return {"i": batch["i"], "x": batch["x"] * 10, "r": np.full(len(batch["i"]), batch_rng().integers(1 << 40))}


@pytest.mark.parametrize("workers", [0, 2])
def test_batch_fn_runs_once_per_batch_with_the_right_values(tmp_path, workers):
    counted = Counted(tmp_path / "calls", scale)
    with Loader(list(range(N)), vec, batch_size=BS, workers=workers, shuffle=True, seed=3, batch_fn=counted) as loader:
        epochs = [[{k: np.array(v) for k, v in b.items()} for b in loader] for _ in range(2)]
        views = [ring_view for b in loader for ring_view in [is_ring_view(b["x"])]]
    assert sum(counted.counts().values()) == 3 * (N // BS)  # once per batch, 3 epochs
    with Loader(list(range(N)), vec, batch_size=BS, workers=0, shuffle=True, seed=3) as plain:
        reference = [[{k: np.array(v) for k, v in b.items()} for b in plain] for _ in range(2)]
    draws = set()
    for got_epoch, ref_epoch in zip(epochs, reference, strict=True):
        assert len(got_epoch) == N // BS
        for got, ref in zip(got_epoch, ref_epoch, strict=True):
            np.testing.assert_array_equal(got["i"], ref["i"])
            np.testing.assert_array_equal(got["x"], ref["x"] * 10)
            assert got["x"].dtype == np.float32
            draws.add(int(got["r"][0]))
    assert len(draws) == 2 * (N // BS)  # batch_rng differs per batch and per epoch
    if workers:
        assert all(views), "batch_fn's output must be packed into ring slots"


def test_batch_rng_is_the_same_for_any_worker_count_and_sample_rng_is_refused_in_batch_fn():
    def run(workers):
        with Loader(list(range(N)), vec, batch_size=BS, workers=workers, shuffle=True, batch_fn=scale) as loader:
            return [np.array(b["r"]) for _ in range(2) for b in loader]

    for a, b in zip(run(0), run(2), strict=True):
        np.testing.assert_array_equal(a, b)

    def bad(batch):
        sample_rng()

    with Loader(list(range(N)), vec, batch_size=BS, workers=0, batch_fn=bad) as loader:
        with pytest.raises(RuntimeError, match="use procpipe.batch_rng"):
            next(iter(loader))
    with pytest.raises(RuntimeError, match="only works inside batch_fn"):
        batch_rng()


def test_batch_fn_after_collate_fn():
    def pad(samples):
        return np.stack([np.pad(s, (0, 5 - len(s))) for s in samples])

    with Loader([np.ones(i % 5 + 1) for i in range(12)], batch_size=4, workers=2, collate_fn=pad,
                batch_fn=lambda b: b.sum(axis=1)) as loader:
        got = np.concatenate([np.array(b) for b in loader])
    np.testing.assert_array_equal(got, [i % 5 + 1 for i in range(12)])


def fail_on_eight(batch):
    if batch["i"][0] == 8:
        raise KeyError("no such column")
    return batch


@pytest.mark.parametrize("workers", [0, 2])
def test_batch_fn_errors_keep_their_type_and_say_where(workers):
    with Loader(list(range(N)), vec, batch_size=BS, workers=workers, batch_fn=fail_on_eight) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(KeyError, match="no such column") as info:
            next(it)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised by batch_fn on the batch of indices [8, 9, 10, 11, 12, 13, 14, 15]" in notes
    if workers:
        assert "raised in worker" in notes
        assert "fail_on_eight" in str(info.value.__cause__)  # the worker's traceback
    else:
        assert "workers=0" in notes


def test_batch_fn_validation():
    with pytest.raises(ValueError, match="batch_fn needs a batch_size"):
        Loader([1, 2], batch_size=None, workers=0, batch_fn=lambda b: b)
    with pytest.raises(TypeError, match="batch_fn must be callable"):
        Loader([1, 2], workers=0, batch_fn=3)


# ------------------------------------------------------------------------ cache
def decode(i):
    """The deterministic stage: a dict of arrays and numbers, from the index alone."""
    return {"i": i, "x": np.linspace(0, 1, 6, dtype=np.float32) * i, "pair": (np.int16(i), float(i) / 2)}


def jitter(sample):
    """The random stage: a sample_rng() draw, and an in-place change (must not reach the cache)."""
    sample["x"] += sample_rng().random(6, dtype=np.float32)
    sample["draw"] = sample_rng().integers(1 << 40)
    return sample


def epochs_of(loader, n=3):
    return [[{k: (np.array(v) if not isinstance(v, tuple) else tuple(map(np.array, v))) for k, v in b.items()}
             for b in loader] for _ in range(n)]


def assert_same(got, ref):
    assert len(got) == len(ref)
    for ge, re_ in zip(got, ref, strict=True):
        assert len(ge) == len(re_)
        for g, r in zip(ge, re_, strict=True):
            assert g.keys() == r.keys()
            for k in g:
                if isinstance(g[k], tuple):
                    for a, b in zip(g[k], r[k], strict=True):
                        assert a.dtype == b.dtype
                        np.testing.assert_array_equal(a, b)
                else:
                    assert g[k].dtype == r[k].dtype, k
                    np.testing.assert_array_equal(g[k], r[k])


def reference_epochs(tmp_path, n=3):
    counted = Counted(tmp_path / "ref-calls", decode)
    with Loader(list(range(N)), counted, batch_size=BS, workers=0, shuffle=True, seed=5, augment=jitter) as loader:
        ref = epochs_of(loader, n)
    assert counted.counts() == {i: n for i in range(N)}  # without a cache, fn runs every epoch
    assert ref[0][0]["draw"].shape == (BS,)  # augment ran
    return ref


@pytest.mark.parametrize("workers,where", [(0, "memory"), (1, "memory"), (2, "memory"), (2, "directory")])
def test_cache_gives_the_same_batches_and_runs_fn_once_per_index(tmp_path, workers, where):
    ref = reference_epochs(tmp_path)
    counted = Counted(tmp_path / "calls", decode)
    cache = True if where == "memory" else str(tmp_path)
    with Loader(list(range(N)), counted, batch_size=BS, workers=workers, shuffle=True, seed=5, augment=jitter,
                cache=cache) as loader:
        info = loader.cache_info()
        assert info["samples"] == N and info["filled"] == 1  # the first sample, computed at creation
        assert info["sample_bytes"] == 8 + 6 * 4 + 2 + 8  # i: int64, x: 6 float32, pair: int16 + float64
        got = epochs_of(loader)
        assert loader.cache_info()["filled"] == N
    assert counted.counts() == {i: 1 for i in range(N)}, "fn must run once per index over 3 epochs"
    assert_same(got, ref)
    assert type(got[0][0]["pair"]) is tuple


def test_cache_without_fn_caches_the_source_and_keeps_python_types(tmp_path):
    Point = collections.namedtuple("Point", "x y")
    source = Counted(tmp_path / "calls", lambda i: [Point(i, float(i)), np.float32(i), True, np.zeros((2, 0))])

    class Source:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return source(i)

    seen = []
    with Loader(Source(), batch_size=None, workers=0, cache=True, augment=lambda s: seen.append(s) or s) as loader:
        for _ in range(2):
            list(loader)
    assert source.counts() == {i: 1 for i in range(6)}
    first, last = seen[0], seen[-1]
    assert type(first[0]) is Point and type(first[0].x) is int and type(first[0].y) is float
    assert type(first[1]) is np.float32 and first[2] is True and first[3].shape == (2, 0)
    assert last[0] == Point(5, 5.0)


class CrashOnce:
    """The cached fn; SIGKILLs its worker the first time any worker computes ``victim``."""

    def __init__(self, marks, victim, parent):
        self.marks, self.victim, self.parent = str(marks), victim, parent

    def __call__(self, i):
        if i == self.victim and os.getpid() != self.parent:
            try:
                os.close(os.open(os.path.join(self.marks, "crashed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                os.kill(os.getpid(), signal.SIGKILL)
            except FileExistsError:
                pass
        return decode(i)


def test_cache_survives_a_worker_crash(tmp_path):
    ref = reference_epochs(tmp_path, 2)
    counted = Counted(tmp_path / "calls", CrashOnce(tmp_path, 13, os.getpid()))
    with Loader(list(range(N)), counted, batch_size=BS, workers=2, shuffle=True, seed=5, augment=jitter,
                cache=True) as loader:
        got = [epochs_of(loader, 1)[0]]
        assert loader.stats()["worker_deaths"] == 1
        got += epochs_of(loader, 1)
        assert loader.stats()["worker_deaths"] == 0
    assert_same(got, ref)
    counts = counted.counts()
    # Index 13 ran twice (the crashed attempt, then the re-run); every other index once: the
    # samples the dead worker had stored before it died were read back, not recomputed.
    assert counts == {**{i: 1 for i in range(N)}, 13: 2}, counts


def varying(i):
    return np.zeros(3 if i < 10 else 4, np.float32)


def test_a_sample_that_does_not_match_the_first_fails_clearly():
    with Loader(list(range(N)), varying, batch_size=BS, workers=2, cache=True) as loader:
        with pytest.raises(CacheError) as info:
            list(loader)
    message = str(info.value)
    assert "sample of index 10 is an array of shape (4,) and dtype float32" in message
    assert "where it is an array of shape (3,) and dtype float32" in message
    assert "fixed-shape" in message and "cache=False" in message
    assert "while loading index 10" in "\n".join(info.value.__notes__)


@pytest.mark.parametrize("sample,field", [({"x": np.zeros(2), "name": "a"}, "sample['name'] is a str"),
                                          (np.array([None, 1]), "dtype object"),
                                          ((1, None), "sample[1] is a NoneType")])
def test_objects_that_are_not_arrays_or_numbers_are_refused_at_creation(sample, field):
    with pytest.raises(CacheError, match="stores arrays and numbers only") as info:
        Loader([0] * 4, lambda i: sample, batch_size=2, workers=2, cache=True)
    assert field in str(info.value)


def test_a_random_cached_stage_is_refused():
    def random_decode(i):
        return sample_rng().random(3)

    with pytest.raises(RuntimeError, match="must be deterministic. Move random augmentation into augment") as info:
        Loader(list(range(8)), random_decode, batch_size=2, workers=0, cache=True)
    assert "computing index 0 to lay out the cache" in "\n".join(info.value.__notes__)


@pytest.mark.parametrize("where", ["memory", "directory"])
def test_a_cache_too_large_fails_at_creation_with_the_fix(tmp_path, where):
    cache = True if where == "memory" else str(tmp_path)
    big = 1 << 50  # a PiB of samples: more than any filesystem here
    with pytest.raises(SharedMemoryError) as info:
        Loader(range(big), lambda i: np.zeros(1024, np.uint8), batch_size=2, workers=2, cache=cache)
    message = str(info.value)
    assert f"for the sample cache ({big} samples x 1024 bytes)" in message and "cache=False" in message
    if where == "memory":
        assert "pass cache='/a/directory/on/disk'" in message
    else:
        assert "larger filesystem" in message
    assert not os.listdir(tmp_path)


def test_cache_validation(tmp_path):
    with pytest.raises(ValueError, match="is not a writable directory"):
        Loader([1], workers=0, cache=str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="cache must be"):
        Loader([1], workers=0, cache=3)
    with pytest.raises(TypeError, match="augment must be callable"):
        Loader([1], workers=0, augment="flip")


@pytest.mark.parametrize("workers", [0, 2])
def test_cache_files_are_removed_on_close(tmp_path, workers, shm_dir):
    directory = tmp_path / "cache"
    directory.mkdir()
    before = our_segments()
    memory = Loader(list(range(N)), decode, batch_size=BS, workers=workers, cache=True)
    in_shm_dir = Loader(list(range(N)), decode, batch_size=BS, workers=workers, cache=True, shm_dir=shm_dir)
    on_disk = Loader(list(range(N)), decode, batch_size=BS, workers=workers, cache=str(directory))
    list(memory), list(in_shm_dir), list(on_disk)
    assert [n for n in our_shm_files() if "cache" in n] == []
    assert any(n.endswith("-cache") for n in our_segments() - before)  # anonymous: no name anywhere
    if workers:
        base = os.path.basename(in_shm_dir.shm_prefix)
        assert sorted(os.listdir(shm_dir)) == [base + "cache", base + "ring0"]
        assert len(os.listdir(directory)) == 1 and os.listdir(directory)[0].endswith("-cache")
    else:  # workers=0: unlinked as soon as it is made; nothing can be left behind
        assert not os.listdir(shm_dir) and not os.listdir(directory)
    memory.close()
    in_shm_dir.close()
    on_disk.close()
    assert our_segments() == before
    assert not os.listdir(directory) and not os.listdir(shm_dir)
    assert memory.cache_info() is None


PARENT = textwrap.dedent('''
    import sys
    import numpy as np
    import procpipe

    def decode(i):
        return np.full(16, i, np.float32)

    if __name__ == "__main__":
        loader = procpipe.Loader(list(range(64)), decode, batch_size=8, workers=2, cache=sys.argv[1])
        list(loader)
        print(loader.shm_prefix, *loader.worker_pids, flush=True)
        sys.stdin.readline()  # killed here
''')


@pytest.mark.allow_leaks  # checked here: the files and processes are the child's
def test_a_directory_cache_is_removed_when_the_parent_is_sigkilled(tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir()
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(script), str(directory)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=python_env(), cwd=str(tmp_path))
    pids = []
    try:
        line = proc.stdout.readline().split()
        assert len(line) == 3, f"the parent did not start: {line}"
        assert line[0] == "None"  # (its ring is anonymous memory: nothing to name or remove)
        pids = [int(p) for p in line[1:]]
        assert len(os.listdir(directory)) == 1
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        assert wait_gone(pids, 10.0) == []
        wait_until(lambda: not os.listdir(directory), 5, "the cache file to be removed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdin.close()
        proc.stdout.close()
        for pid in pids:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))


def test_augment_without_cache_runs_after_fn_every_epoch(tmp_path):
    counted = Counted(tmp_path / "calls", jitter)
    with Loader(list(range(N)), decode, batch_size=BS, workers=2, augment=counted) as loader:
        got = epochs_of(loader, 2)
    assert counted.counts() == {i: 2 for i in range(N)}
    assert got[0][0]["draw"].shape == (BS,) and not np.array_equal(got[0][0]["draw"], got[1][0]["draw"])
