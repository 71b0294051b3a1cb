"""Errors: user exceptions from the workers, collation errors, bad arguments, shared-memory capacity."""
from __future__ import annotations

import os
import re

import numpy as np
import psutil
import pytest
from conftest import descendants, our_segments, our_shm_files, run_python, wait_until

import procpipe
from procpipe import CollateError, Loader, RemoteTraceback, SharedMemoryError, WorkerError

N, BS, BAD = 40, 4, 13  # index 13 is in batch 3 (indices 12..15)


class Boom(ValueError):
    """A user exception type: must arrive with this exact type."""


class NeedsTwoArgs(Exception):
    """Pickles, but cannot be unpickled (``args`` holds one value, ``__init__`` needs two)."""

    def __init__(self, what, where):
        super().__init__(f"{what} at {where}")


class HoldsGenerator(Exception):
    """Cannot even be pickled: its ``__dict__`` holds a generator."""

    def __init__(self, message):
        super().__init__(message)
        self.pending = (i for i in range(3))


class Failing:
    """Source, fn and collate_fn in one: raises ``error`` at ``where`` for index BAD while ``flag`` exists."""

    def __init__(self, where, flag, error="boom"):
        self.where, self.flag, self.error = where, str(flag), error

    def _maybe_raise(self, where, i):
        if where == self.where and i == BAD and os.path.exists(self.flag):
            if self.error == "two-args":
                raise NeedsTwoArgs("bad item", i)
            if self.error == "generator":
                raise HoldsGenerator(f"bad item {i}")
            raise Boom(f"bad item {i}")

    def __len__(self):
        return N

    def __getitem__(self, i):
        self._maybe_raise("getitem", i)
        return i

    def fn(self, i):
        self._maybe_raise("fn", i)
        return np.full(3, i, np.int64)

    def collate(self, samples):
        for s in samples:
            self._maybe_raise("collate", int(s[0]))
        return np.stack(samples)


def _notes(exc):
    return "\n".join(getattr(exc, "__notes__", []))


def _first_column(batches):
    return [b[:, 0].tolist() for b in batches]


EXPECTED = [list(range(k, min(k + BS, N))) for k in range(0, N, BS)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("where", ["fn", "getitem", "collate"])
def test_user_exception_keeps_type_index_and_traceback(tmp_path, where, workers):
    flag = tmp_path / "fail"
    flag.touch()
    f = Failing(where, flag)
    with Loader(f, f.fn, batch_size=BS, workers=workers, collate_fn=f.collate) as loader:
        got = []
        with pytest.raises(Boom) as info:
            for batch in loader:
                got.append(batch[:, 0].tolist())
        exc = info.value
        assert type(exc) is Boom
        assert str(exc) == f"bad item {BAD}"
        assert got == EXPECTED[:BAD // BS], "ordered batches before the failing one must be delivered first"
        notes = _notes(exc)
        if where == "collate":
            assert "[12, 13, 14, 15]" in notes
        else:
            assert f"index {BAD}" in notes
        if workers:
            cause = exc.__cause__
            assert isinstance(cause, RemoteTraceback)
            for text in ("Traceback (most recent call last)", "_maybe_raise", "test_errors.py",
                         f"Boom: bad item {BAD}"):
                assert text in cause.tb
                assert text in str(cause)
            assert "worker" in notes
        # the loader recovers: a new epoch delivers everything
        flag.unlink()
        assert _first_column(loader) == EXPECTED
        assert _first_column(loader) == EXPECTED


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("where", ["getitem", "collate"])
def test_a_failing_batch_raises_and_the_iteration_goes_on(tmp_path, where, ordered, workers):
    """As torch's DataLoader: next() raises the batch's exception, the next next() returns the
    batch after it, and the epoch ends when its batches do (not at the first error)."""
    flag = tmp_path / "fail"
    flag.touch()
    f = Failing(where, flag)
    with Loader(f, f.fn, batch_size=BS, workers=workers, ordered=ordered, collate_fn=f.collate) as loader:
        it = iter(loader)
        got, errors = [], []
        for _ in range(len(loader) + 1):  # one next() more than there are batches
            try:
                got.append(next(it)[:, 0].tolist())
            except Boom as exc:
                errors.append(str(exc))
            except StopIteration:
                break
        else:
            pytest.fail("the iterator did not end after the epoch's batches")
        assert errors == [f"bad item {BAD}"]
        expected = [b for b in EXPECTED if BAD not in b]
        assert (got if ordered else sorted(got)) == expected
        flag.unlink()
        rest = _first_column(loader)
        assert (rest if ordered else sorted(rest)) == EXPECTED  # and the next epoch is whole


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("error", ["two-args", "generator"])
def test_exception_that_cannot_travel_becomes_worker_error(tmp_path, error, ordered):
    flag = tmp_path / "fail"
    flag.touch()
    f = Failing("fn", flag, error=error)
    with Loader(f, f.fn, batch_size=BS, workers=2, ordered=ordered) as loader:
        with pytest.raises(WorkerError) as info:
            for _ in loader:
                pass
        exc = info.value
        name = "NeedsTwoArgs" if error == "two-args" else "HoldsGenerator"
        assert name in str(exc) and "bad item" in str(exc)
        assert f"index {BAD}" in _notes(exc)
        assert isinstance(exc.__cause__, RemoteTraceback)
        assert name in exc.__cause__.tb and "_maybe_raise" in exc.__cause__.tb
        flag.unlink()
        assert sorted(_first_column(loader)) == EXPECTED


# --------------------------------------------------------------------------- collation
def shape_mismatch(i):
    return {"image": np.zeros(4 if i == 5 else 3), "label": i}


def dtype_mismatch(i):
    return {"label": np.zeros(2, np.int64 if i == 6 else np.float32)}


def object_array(i):
    return {"blob": np.array([i, "text"], dtype=object) if 4 <= i < 8 else np.zeros(2)}


def key_mismatch(i):
    return {"a": i, "extra": i} if i == 5 else {"a": i}


def nested_mismatch(i):
    return {"meta": {"shape": np.zeros((2, 2) if i == 7 else (2, 3))}}


COLLATE_CASES = {
    "shape": (shape_mismatch, ["sample['image']", "[4, 5, 6, 7]", "index 5", "(3,)", "(4,)", "collate_fn"]),
    "dtype": (dtype_mismatch, ["sample['label']", "[4, 5, 6, 7]", "index 6", "float32", "int64", "collate_fn"]),
    "object": (object_array, ["sample['blob']", "index 4", "object", "collate_fn"]),
    "keys": (key_mismatch, ["index 4", "index 5", "'extra'", "collate_fn"]),
    "nested": (nested_mismatch, ["sample['meta']['shape']", "index 7", "(2, 3)", "(2, 2)", "collate_fn"]),
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("case", sorted(COLLATE_CASES))
def test_unstackable_samples_raise_collate_error(case, workers):
    fn, fragments = COLLATE_CASES[case]
    with Loader(list(range(12)), fn, batch_size=4, workers=workers) as loader:
        with pytest.raises(CollateError) as info:
            list(loader)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert isinstance(info.value, TypeError)
    assert "[4, 5, 6, 7]" in _notes(info.value)
    if workers:
        assert isinstance(info.value.__cause__, RemoteTraceback)


# --------------------------------------------------------------------------- arguments
class NoLen:
    def __getitem__(self, i):
        return i


BAD_ARGUMENTS = [
    (dict(workers=-1), ValueError, r"workers must be an int >= 0, got -1"),
    (dict(workers=1.5), ValueError, r"workers must be an int"),
    (dict(batch_size=0), ValueError, r"batch_size must be an int >= 1 or None, got 0"),
    (dict(prefetch=0), ValueError, r"prefetch must be an int >= 1, got 0"),
    (dict(source=NoLen()), TypeError, r"__len__"),
    (dict(source=(i for i in range(3))), TypeError, r"__len__"),
    (dict(fn=42), TypeError, r"fn must be callable"),
    (dict(collate_fn="stack"), TypeError, r"collate_fn must be callable"),
    (dict(start_method="thread"), ValueError, r"start_method must be one of .*forkserver.*'thread'"),
    (dict(shm_dir="/nonexistent/procpipe-test"), ValueError,
     r"shm_dir='/nonexistent/procpipe-test' is not a writable directory"),
    (dict(shm_dir=__file__), ValueError, r"is not a writable directory"),
    (dict(slot_bytes=0), ValueError, r"slot_bytes"),
]


# ids without memory addresses: the same in every process (pytest-xdist's workers must collect the same tests)
@pytest.mark.parametrize(("kwargs", "error", "pattern"), BAD_ARGUMENTS,
                         ids=[re.sub(r" at 0x[0-9a-f]+", "", repr(k)) for k, _, _ in BAD_ARGUMENTS])
def test_bad_arguments_fail_at_construction(kwargs, error, pattern):
    kwargs = dict(kwargs)
    source = kwargs.pop("source", list(range(10)))
    before = descendants(include_infrastructure=False)
    with pytest.raises(error, match=pattern):
        Loader(source, **kwargs)
    assert descendants(include_infrastructure=False) == before, "a worker was started before validation"


def test_unpicklable_fn_raises_clear_type_error():
    stream = (i for i in range(10))
    with pytest.raises(TypeError, match=r"cannot send the source, fn or collate_fn to its workers: .*generator"):
        Loader(list(range(10)), lambda i: (i, stream), workers=1, start_method="forkserver")


# --------------------------------------------------------------------------- shared-memory capacity
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _bytes(number: str, unit: str) -> float:
    return float(number) * _UNITS[unit]


def test_a_ring_larger_than_memory_raises_shared_memory_error():
    from procpipe._core.memory_budget import memory_budget

    budget = memory_budget()
    before = our_shm_files(), our_segments()
    with pytest.raises(SharedMemoryError) as info:
        Loader(list(range(10)), batch_size=2, workers=1, slot_bytes=budget.available + 2**30)
    message = str(info.value)
    m = re.search(r"needs ([\d.]+) (\w+) of memory for (\d+) ring slots .* but (.*) leaves ([\d.]+) (\w+)", message)
    assert m, message
    needed, left = _bytes(m.group(1), m.group(2)), _bytes(m.group(5), m.group(6))
    assert needed >= budget.available + 2**30 and left < needed
    assert m.group(4).startswith(budget.limit.split(" (")[0])  # which limit: the cgroup's, or available memory
    for fix in ("prefetch", "docker run --memory", "resources.limits.memory"):
        assert fix in message
    assert isinstance(info.value, MemoryError) and isinstance(info.value, procpipe.ProcpipeError)
    assert (our_shm_files(), our_segments()) == before


def test_a_ring_larger_than_its_shm_dir_raises_shared_memory_error():
    usage = psutil.disk_usage("/dev/shm")
    before = our_shm_files()
    with pytest.raises(SharedMemoryError) as info:
        Loader(list(range(10)), batch_size=2, workers=1, slot_bytes=usage.total + 2**30, shm_dir="/dev/shm")
    message = str(info.value)
    m = re.search(r"needs ([\d.]+) (\w+) in /dev/shm .* only ([\d.]+) (\w+) is free", message)
    assert m, message
    needed, free = _bytes(m.group(1), m.group(2)), _bytes(m.group(3), m.group(4))
    assert needed >= usage.total + 2**30
    assert free < needed and abs(free - usage.free) < 0.2 * usage.total
    for fix in ("prefetch", "shm_dir", "leave shm_dir out"):
        assert fix in message
    assert our_shm_files() == before


UNGUARDED = """
import os
import sys
import numpy as np
import procpipe

def double(i):
    return np.int64(2 * i)

# No `if __name__ == "__main__":` guard: workers do not import this script, so none is needed.
print("script body ran", os.getpid())
loader = procpipe.Loader(list(range(8)), double, batch_size=2, workers=2, start_method=sys.argv[1])
try:
    print(sum(int(b.sum()) for b in loader))
finally:
    loader.close()
"""


@pytest.mark.parametrize("start_method", ["auto", "forkserver", "spawn", "fork"])
def test_a_script_without_a_main_guard_works(tmp_path, start_method):
    """The classic forkserver/spawn mistake is no mistake: workers never import the main
    script (procpipe._worker.start_method), so the script runs once and multiprocess prints nothing."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    result = run_python([str(script), start_method], timeout=120, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:3] + words[4:] == ["script", "body", "ran", "56"], result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    prefix = f"procpipe-{words[3]}-"
    wait_until(lambda: not [f for f in os.listdir("/dev/shm") if f.startswith(prefix)], 30,
               "the script's and its workers' shared-memory files to be removed")
