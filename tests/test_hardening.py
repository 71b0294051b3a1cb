"""Hardening: data comes back exactly as produced, outside inputs are validated, and every
file procpipe creates is owner-only, never followed, and tamper-evident (cache checksums)."""
from __future__ import annotations

import glob
import os
import pickle
import re
import secrets
import shutil
import signal
import stat
import subprocess
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import loader_token, run_python, segment_fds

import procpipe
from procpipe import CacheError, Loader
from procpipe._engine.faults import death_message, timeout_message

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


# ------------------------------------------------------------------ 7. files: owner-only, never followed, tamper-evident
def eight(i):
    return np.full(8, i, np.int64)  # 64 bytes a sample: a cache field with no padding


FIXED_TOKEN = "feedbeef"


@pytest.mark.parametrize("name", ["ring0", "cache"])  # (the only files: the rest is anonymous memory, unnamed)
def test_a_planted_symlink_is_never_followed(name, shm_dir, tmp_path, monkeypatch):
    # Another local user can read a loader's prefix; here the prefix is made predictable instead.
    monkeypatch.setattr(secrets, "token_hex", lambda nbytes=None: FIXED_TOKEN)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me")
    target.chmod(0o640)
    link = os.path.join(str(cache_dir) if name == "cache" else shm_dir, f"procpipe-{os.getpid()}-{FIXED_TOKEN}-{name}")
    os.symlink(target, link)
    try:
        with pytest.raises(FileExistsError, match="will not reuse or follow an existing file"):
            with Loader(list(range(N)), eight, batch_size=BS, workers=1, shm_dir=shm_dir, start_method="forkserver",
                        cache=str(cache_dir)) as loader:
                list(loader)
    finally:
        if os.path.islink(link):
            os.unlink(link)
    assert target.read_text() == "keep me"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert os.listdir(cache_dir) == []


def test_every_file_procpipe_creates_is_owner_only(shm_dir, tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    old_umask = os.umask(0o022)  # the usual umask: plain open(path, "w") gives 0644
    try:
        with Loader(list(range(N)), eight, batch_size=BS, workers=2, shm_dir=shm_dir, cache=str(cache_dir),
                    start_method="forkserver") as loader:
            list(loader)
            paths = glob.glob(os.path.join(shm_dir, "*")) + glob.glob(os.path.join(cache_dir, "*"))
            modes = {p.rsplit("-", 1)[1]: stat.S_IMODE(os.lstat(p).st_mode) for p in paths}
    finally:
        os.umask(old_umask)
    assert set(modes) == {"ring0", "cache"}  # (the spec, the status words...: anonymous memory, no file)
    assert modes == dict.fromkeys(modes, 0o600)


class RunsCode:
    """What someone could put in place of the shipped spec: unpickling it runs code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.parametrize("shm", ["anonymous", "directory"])
def test_no_process_can_change_the_spec_workers_unpickle(shm, shm_dir, tmp_path):
    # The spec (the pickled dataset and functions) has no name to replace, and its memory is sealed:
    # not even a process holding it (a worker) can write, shrink or grow it.
    marker = tmp_path / "ran"
    with Loader(list(range(N)), eight, batch_size=BS, workers=1, start_method="forkserver",
                **({"shm_dir": shm_dir} if shm == "directory" else {})) as loader:
        fd, = segment_fds(loader_token(loader) + "spec")
        data = pickle.dumps(RunsCode(str(marker)))
        for change in (lambda: os.pwrite(fd, data, 0), lambda: os.ftruncate(fd, 1), lambda: os.ftruncate(fd, 1 << 20)):
            with pytest.raises(PermissionError):
                change()
        if shm == "directory":
            assert glob.glob(os.path.join(shm_dir, "*spec*")) == []
        os.kill(loader.worker_pids[0], signal.SIGKILL)  # its replacement loads the spec again
        assert [int(b[0, 0]) for b in loader] == list(range(0, N, BS))
    assert not marker.exists()


def test_open_owned_refuses_symlinks_and_shared_files(tmp_path):
    from procpipe._core.shm import open_owned

    mine = tmp_path / "mine"
    mine.write_bytes(b"x")
    mine.chmod(0o600)
    os.close(open_owned(str(mine)))
    os.symlink(mine, tmp_path / "link")
    with pytest.raises(PermissionError, match="symlink"):
        open_owned(str(tmp_path / "link"))
    mine.chmod(0o644)
    with pytest.raises(PermissionError, match="mode 0600"):
        open_owned(str(mine))


@pytest.mark.parametrize("option", ["shm_dir", "cache"])
def test_a_directory_others_can_write_without_sticky_bit_is_refused(option, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"no sticky bit.*chmod \+t"):
        Loader(list(range(N)), eight, batch_size=BS, workers=0, **{option: str(shared)})
    shared.chmod(0o1777)  # like /dev/shm and /tmp: others cannot replace our files
    with Loader(list(range(N)), eight, batch_size=BS, workers=0, **{option: str(shared)}) as loader:
        assert len(list(loader)) == N // BS


TRUNCATE_SCRIPT = r"""
import glob, os, sys
import numpy as np
import procpipe
from procpipe import CacheError


def eight(i):
    return np.full(8, i, np.int64)


if __name__ == "__main__":
    where, shm_dir = sys.argv[1:3]
    with procpipe.Loader(list(range(40)), eight, batch_size=4, workers=2, shm_dir=shm_dir,
                         cache=True if where == "memory" else where) as loader:
        list(loader)
        path, = glob.glob(os.path.join(loader.cache_info()["directory"], f"procpipe-{os.getpid()}-*-cache"))
        os.truncate(path, os.path.getsize(path) // 2)
        info = loader.cache_info()  # a status query reports the damage, it does not raise
        print("cache_info", info["filled"], path in info["error"], "truncated" in info["error"], flush=True)
        for what, call in (("epoch", lambda: list(loader)),):
            try:
                call()
                print(what, "no error", flush=True)
            except CacheError as exc:
                print(what, "CacheError", path in str(exc), "truncated" in str(exc), flush=True)
            except Exception as exc:
                print(what, type(exc).__name__, str(exc)[:300], flush=True)
"""


@pytest.mark.parametrize("where", ["memory", "directory"])
def test_a_truncated_cache_file_is_a_cache_error_naming_it(where, tmp_path, shm_dir):
    # In a subprocess: before the fix, cache_info() killed the interpreter with SIGBUS. (A file: the
    # cache in memory with an shm_dir, or in a directory; anonymous memory cannot be truncated, below.)
    script = tmp_path / "truncate.py"
    script.write_text(TRUNCATE_SCRIPT)
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    result = run_python([str(script), "memory" if where == "memory" else str(cache_dir), shm_dir])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["cache_info None True True", "epoch CacheError True True"], result.stdout


@pytest.mark.parametrize("lengths", [True, False], ids=["indexed", "growing-stream"])
def test_a_cache_in_anonymous_memory_cannot_be_truncated(lengths):
    # No SIGBUS to guard against: its memory is sealed against shrinking (a stream's may still grow).
    source = procpipe.Shards([(s, 10) for s in range(4)], _records, lengths=[10] * 4 if lengths else None)
    with Loader(source, eight, batch_size=BS, workers=2, cache=True) as loader:
        first = [b[:, 0].tolist() for b in loader]
        fd = segment_fds(loader_token(loader) + "cache")[0]  # (its own, or the mapping's copy: one memory)
        size = os.fstat(fd).st_size
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size // 2)
        assert os.fstat(fd).st_size == size
        assert [b[:, 0].tolist() for b in loader] == first
        assert loader.cache_info()["error"] is None


def _records(shard):
    yield from range(shard[0] * 10, shard[0] * 10 + shard[1])


def test_changed_bytes_in_a_directory_cache_are_a_cache_error(tmp_path):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    with Loader(list(range(N)), eight, batch_size=BS, workers=2, cache=str(cache_dir)) as loader:
        assert [int(b[0, 0]) for b in loader] == list(range(0, N, BS))
        path, = glob.glob(os.path.join(cache_dir, "*-cache"))
        with open(path, "r+b") as f:  # the last 8 bytes: the last element of index N - 1
            f.seek(-8, os.SEEK_END)
            f.write(np.int64(-1).tobytes())
        with pytest.raises(CacheError, match=re.escape(path) + ".*corrupt"):
            list(loader)


# ------------------------------------------------------------------ 6. outside inputs validated
@pytest.mark.parametrize("change", [
    {"done_below": 10**10},  # would build a set of 10**10 positions
    {"done_below": 15},  # past the epoch's 10 batches: silently an empty epoch
    {"done_below": 2, "done": [4, 10]},
    {"ahead": [[1, 11, []]]},
])
def test_positions_outside_the_epoch_in_a_saved_state_are_refused(change):
    with Loader(list(range(N)), eight, batch_size=BS, workers=0, epochs=None) as loader:
        assert len(loader) == 10
        state = dict(loader.state_dict(), **change)
        with pytest.raises(ValueError, match="out of range.*10 batches"):
            loader.load_state_dict(state)
        loader.load_state_dict(dict(loader.state_dict(), done_below=10))  # the whole epoch done: fine


class TwoBatches:
    def __init__(self, first):
        self.first = first

    def __len__(self):
        return 2

    def __call__(self, epoch):
        return [[self.first], [0]]


@pytest.mark.parametrize("index", [True, np.True_])
def test_a_boolean_is_not_an_index_in_batches(index):
    with Loader(list(range(N)), batch_size=None, workers=0, batches=TwoBatches(index)) as loader:
        with pytest.raises(TypeError, match="integer indices"):
            list(loader)


WORKER_ENV_SCRIPT = r"""
import os
import procpipe


def read_env(i):
    return os.environ.get("PROCPIPE_TEST_FIRST", "unset"), os.environ.get("PROCPIPE_TEST_SECOND", "unset")


if __name__ == "__main__":
    for env in ({"PROCPIPE_TEST_FIRST": "1"}, {"PROCPIPE_TEST_SECOND": "2"}):
        with procpipe.Loader([0, 1], read_env, batch_size=None, workers=1, worker_env=env) as loader:
            print(*sorted(set(loader)), flush=True)
"""


def test_worker_env_of_one_loader_does_not_leak_into_the_next(tmp_path):
    # A fresh process: the forkserver must be started by the first loader for the leak to show.
    script = tmp_path / "worker_env.py"
    script.write_text(WORKER_ENV_SCRIPT)
    result = run_python([str(script)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["('1', 'unset')", "('unset', '2')"]


def fake_worker(exitcode, rss):
    return SimpleNamespace(index=0, exitcode=exitcode, describe=lambda: "worker 0 (pid 123)",
                           counters=SimpleNamespace(rss_bytes=rss))


def test_error_messages_summarize_a_large_batch_and_say_when_rss_is_unknown():
    job = SimpleNamespace(seq=3, payload=list(range(20_000)), timeouts=2)
    message = timeout_message(job, 150, 2.0, 0)
    assert len(message) < 1000 and "20000 indices [0, 1, 2" in message and "19999]" in message
    lost = [SimpleNamespace(job=job)]
    message = death_message(fake_worker(-signal.SIGKILL, 0), lost, 150, 3)
    assert len(message) < 1500 and "20000 indices [0, 1, 2" in message
    assert "RSS 0 MiB" not in message and "RSS is unknown" in message
    message = death_message(fake_worker(-signal.SIGKILL, 300 * 2**20), lost, 150, 3)
    assert "last sampled RSS was 300 MiB" in message


FULL_SHM_SCRIPT = r"""
import errno, os, sys
import procpipe

if __name__ == "__main__":
    directory = sys.argv[1]
    try:
        with open(os.path.join(directory, "filler"), "wb") as f:  # fill the filesystem
            while True:
                f.write(b"x" * 4096)
                f.flush()
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    try:
        with procpipe.Loader(list(range(8)), batch_size=2, workers=1, shm_dir=directory) as loader:
            list(loader)  # (the ring is made as the first batch arrives)
        print("no error")
    except procpipe.SharedMemoryError as exc:
        print("SharedMemoryError", directory in str(exc), "leave shm_dir out" in str(exc))
    except Exception as exc:
        print(type(exc).__name__, exc)
    os.unlink(os.path.join(directory, "filler"))
    print("left:", sorted(os.listdir(directory)))
"""


def test_a_full_shm_dir_is_a_shared_memory_error(tmp_path):
    # A real full filesystem, without root: a 256 KiB tmpfs in a user + mount namespace.
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    script = tmp_path / "full.py"
    script.write_text(FULL_SHM_SCRIPT)
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=256k tmpfs "$0"', str(mount_point)],
                           capture_output=True, text=True, timeout=60) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"needs unprivileged user namespaces to mount a small tmpfs: {probe and probe.stderr.strip()}")
    result = run_python(["-c", "import subprocess, sys; sys.exit(subprocess.call(['unshare', '-rm', 'sh', '-c', "
                         "'mount -t tmpfs -o size=256k tmpfs \"$0\" && exec \"$1\" \"$2\" \"$0\"', "
                         f"{str(mount_point)!r}, sys.executable, {str(script)!r}]))"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["SharedMemoryError True True", "left: []"], result.stdout + result.stderr[-3000:]


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
