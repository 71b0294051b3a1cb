"""Errors: user exceptions from the workers, collation errors, bad arguments, shared-memory capacity."""
from __future__ import annotations

import os
import re
import signal
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
from conftest import descendants, our_segments, our_shm_files, run_python, wait_until

import procpipe
from procpipe import CollateError, Loader, RemoteTraceback, SharedMemoryError, WorkerError
from procpipe._engine.faults import death_message, timeout_message

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


def forgot_return(sample):
    sample * 2  # no return


@pytest.mark.parametrize("workers", [0, 1])
def test_fn_returning_none_says_so(workers):
    with procpipe.Loader(list(range(8)), forgot_return, batch_size=4, workers=workers) as loader:
        with pytest.raises(TypeError, match=r"fn returned None for index 0.*forget a `return`"):
            list(loader)


def test_none_samples_with_a_collate_fn_are_the_users_business():
    with procpipe.Loader(list(range(4)), forgot_return, batch_size=2, workers=0, collate_fn=len) as loader:
        assert list(loader) == [2, 2]


def test_an_empty_source_warns():
    with pytest.warns(UserWarning, match=r"yields no batch: the source is empty"):
        loader = procpipe.Loader([], batch_size=4, workers=0)
    assert list(loader) == []
    with pytest.warns(UserWarning, match=r"drop_last=True drops the only, partial batch \(3 samples < batch_size=4\)"):
        procpipe.Loader([1, 2, 3], batch_size=4, workers=0, drop_last=True)


def test_a_large_ring_says_so_once(monkeypatch):
    import procpipe._core.rings

    assert procpipe._core.rings.is_large_reservation(2 << 30, 100 << 30)  # over 1 GiB
    assert procpipe._core.rings.is_large_reservation(300 << 20, 1 << 30)  # over a quarter of what is free
    assert not procpipe._core.rings.is_large_reservation(100 << 20, 1 << 30)
    monkeypatch.setattr(procpipe._core.rings, "LARGE_RESERVATION_BYTES", 1024)
    with pytest.warns(UserWarning, match=r"the ring reserves .* slots of .*lower it: a smaller prefetch") as record:
        with procpipe.Loader(np.zeros((64, 256), np.float32), batch_size=8, workers=1) as loader:
            for _ in range(2):
                assert sum(len(b) for b in loader) == 64
    assert sum("the ring reserves" in str(w.message) for w in record) == 1



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


# --------------------------------------------------------------------------- unpicklable sample
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


# --------------------------------------------------------------------------- an open file in a sample
class _WithOpenFile:
    """Sample 5 holds an open file, 11 bytes read: it cannot reach the consumer as the same handle."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        handle = None
        if i == 5:
            handle = open(self.path, "rb")  # noqa: SIM115 - the point: a handle in the sample
            handle.read(11)
        return {"x": np.float32(i), "h": handle}


def _data_file(tmp_path) -> str:
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(64)))
    return str(path)


def _errors_and_batches(loader, pick) -> tuple[list[str], list]:
    got, errors = [], []
    it = iter(loader)
    while True:
        try:
            got.append(pick(next(it)))
        except StopIteration:
            return errors, got
        except procpipe.CollateError as exc:
            errors.append(str(exc))


def _assert_names_the_open_file(errors: list[str]) -> None:
    assert len(errors) == 1, errors
    message = errors[0]
    assert "sample['h'] of index 5" in message and "open file" in message, message
    assert "position 0" in message and "Return the path" in message, message  # why, and the fix


def test_an_open_file_in_a_sample_is_its_batchs_error(tmp_path) -> None:
    with procpipe.Loader(_WithOpenFile(_data_file(tmp_path)), batch_size=4, workers=2, shuffle=False) as loader:
        errors, got = _errors_and_batches(loader, lambda b: b["x"].tolist())
        deaths = loader.stats()["worker_deaths"]
    _assert_names_the_open_file(errors)
    assert got == [[0.0, 1.0, 2.0, 3.0]]  # the other batch arrives; the error is that batch's
    assert deaths == 0


@pytest.mark.parametrize("batch_size", [4, None], ids=["pass_through_collate", "unbatched"])
def test_an_open_file_in_a_torch_sample_is_its_batchs_error(tmp_path, batch_size) -> None:
    pytest.importorskip("torch")
    import procpipe.torch

    dataset = _WithOpenFile(_data_file(tmp_path))
    extra = {"collate_fn": lambda batch: batch} if batch_size else {}
    loader = procpipe.torch.DataLoader(dataset, batch_size=batch_size, num_workers=2, **extra)
    errors, got = _errors_and_batches(loader, lambda b: b)
    _assert_names_the_open_file(errors)
    assert len(got) == (1 if batch_size else 7)


# --------------------------------------------------------------------------- what an error does to an epoch
def _catching_loop(it, limit: int = 200) -> tuple[int, list[BaseException], bool]:
    """A loop that catches what next() raises and calls it again (the pattern the docs show):
    batches, errors, and whether it ended (StopIteration) within ``limit`` calls."""
    got, errors = 0, []
    for _ in range(limit):
        try:
            next(it)
            got += 1
        except StopIteration:
            return got, errors, True
        except Exception as exc:  # noqa: BLE001 - the loop under test catches everything
            errors.append(exc)
    return got, errors, False


def _fails_at_5(i: int) -> np.float32:
    if i == 5:
        raise KeyError(i)
    return np.float32(i)


def _records_then_fails(shard: int):
    yield from range(4)
    if shard == 1:
        raise OSError("the shard's file is truncated")


def _dies_at_5(i: int) -> np.float32:
    if i == 5:
        os._exit(3)
    return np.float32(i)


def _loader(kind: str, workers: int, device: str | None) -> procpipe.Loader:
    extra = {"device": device} if device else {}
    if kind == "batch error":
        return procpipe.Loader(list(range(12)), _fails_at_5, batch_size=2, workers=workers, shuffle=False, **extra)
    if kind == "stream error":
        return procpipe.Loader(procpipe.Shards([0, 1, 2], _records_then_fails), batch_size=2, workers=workers,
                               **extra)
    return procpipe.Loader(list(range(12)), _dies_at_5, batch_size=2, workers=workers, shuffle=False,
                           max_worker_restarts=0, **extra)


@pytest.mark.parametrize("device", [None, "cpu"], ids=["plain", "device_stage"])
@pytest.mark.parametrize(("kind", "workers"), [("batch error", 0), ("batch error", 2), ("stream error", 0),
                                               ("stream error", 2), ("worker crash loop", 2)])
def test_a_loop_that_catches_errors_ends_with_the_epoch(kind: str, workers: int, device) -> None:
    if device:
        pytest.importorskip("torch")
    with _loader(kind, workers, device) as loader:
        got, errors, ended = _catching_loop(iter(loader))
    assert ended, f"next() kept raising: {len(errors)} errors, the last {errors[-1]!r}"
    assert len(errors) == 1, errors  # told once
    if kind == "batch error":  # only that batch is lost: the loop gets the batches after it (as torch's)
        assert isinstance(errors[0], KeyError) and got == 5
    elif kind == "stream error":
        assert isinstance(errors[0], OSError)
    else:
        assert isinstance(errors[0], procpipe.WorkerError)
