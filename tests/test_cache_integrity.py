"""``cache=`` is tamper-evident: a truncated file, changed bytes, and a cache in anonymous memory
(which cannot be truncated) are each a ``CacheError`` naming the file, never silently wrong data."""
from __future__ import annotations

import glob
import os
import re

import numpy as np
import pytest
from conftest import loader_token, run_python, segment_fds

import procpipe
from procpipe import CacheError, Loader

N, BS = 40, 4


def eight(i):
    return np.full(8, i, np.int64)  # 64 bytes a sample: a cache field with no padding


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
