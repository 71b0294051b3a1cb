"""procpipe.Records: packing, list-like access, errors, pickling, workers, lifetime, save/load."""
from __future__ import annotations

import gc
import os
import pickle
import selectors
import signal
import subprocess
import sys
import textwrap

import dill
import numpy as np
import pytest
from conftest import loader_token, mappings, our_shm_files, python_env, segment_fds, wait_gone, wait_until

import procpipe
from procpipe import Loader, Records

ROWS = [
    {"path": "/data/a.jpg", "label": 3, "weight": 0.5, "train": True, "raw": b"\x00\xff", "f32": np.float32(1.5),
     "u64": np.uint64(2**64 - 1), "mixed": 1, "text": "snowman ☃"},
    {"path": "", "label": -2**63, "weight": float("inf"), "train": False, "raw": b"", "f32": np.float32(-2.0),
     "u64": np.uint64(0), "mixed": 2.5, "text": "bad \udcff surrogate"},
    {"path": "é" * 300, "label": 2**63 - 1, "weight": -0.0, "train": np.bool_(True), "raw": bytes(range(256)),
     "f32": np.float32(0), "u64": np.uint64(7), "mixed": -3, "text": "\U0001F600"},
]
TYPES = {"path": str, "label": int, "weight": float, "train": bool, "raw": bytes, "f32": float, "u64": int,
         "mixed": float, "text": str}
DTYPES = {"label": np.int64, "weight": np.float64, "train": np.bool_, "f32": np.float32, "u64": np.uint64,
          "mixed": np.float64}


def file_of(records: Records) -> str:
    """The (already unlinked) file behind a Records made in this process, as /proc/*/maps names it."""
    return os.readlink(f"/proc/self/fd/{records._store.where[2]}")


def maps_of(pid: int, name: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return name in f.read()


def path_and_label(record):
    return record["path"], record["label"]


def meta(n):
    return [{"path": f"/data/images/{i:07d}.jpg", "label": i % 1000} for i in range(n)]


# --------------------------------------------------------------------------- values
def test_round_trip_every_column_kind():
    with Records(ROWS) as records:
        assert len(records) == 3 and records.columns == tuple(ROWS[0])
        for got, want in zip(records, ROWS, strict=True):
            assert got == want and list(got) == list(want)
            assert {key: type(value) for key, value in got.items()} == TYPES  # Python values, not numpy
        assert records[1]["text"] == "bad \udcff surrogate" and records[2]["u64"] == 7
        for key, dtype in DTYPES.items():
            column = records.column(key)
            assert column.dtype == dtype and not column.flags.writeable
            np.testing.assert_array_equal(column, np.array([r[key] for r in ROWS], dtype))
        assert records.column("path") == [r["path"] for r in ROWS]
        assert records.column("raw") == [r["raw"] for r in ROWS]
        assert records.nbytes >= 3 * 256 and "3 dict records" in repr(records) and "f32: float32" in repr(records)
    assert repr(records) == "<procpipe.Records, closed>"


@pytest.mark.parametrize("values, dtype", [
    ([1, 2**63], np.uint64),  # Python ints are exact: int64, else uint64, never a float
    ([-1, 2**63 - 1], np.int64),
    ([1, 2.5], np.float64),
    ([np.int16(1), np.int16(-2)], np.int16),
    ([np.float32(1), np.float32(2)], np.float32),
])
def test_numeric_column_dtypes(values, dtype):
    with Records([{"v": v} for v in values]) as records:
        assert records.column("v").dtype == dtype and [r["v"] for r in records] == values


@pytest.mark.parametrize("items", [
    [("a", 1, 2.0), ("bb", -1, 3.5)],  # tuples
    ["x", "yy", ""],  # scalars
    [10, 20, 30],
    [b"q", b""],
], ids=["tuples", "str", "int", "bytes"])
def test_tuples_and_scalars(items):
    with Records(iter(items)) as records:  # any iterable
        assert list(records) == items and [type(v) for v in records] == [type(v) for v in items]
        assert records.columns == ((0, 1, 2) if isinstance(items[0], tuple) else (0,))
        column = records.column(0)
        assert (column if isinstance(column, list) else column.tolist()) == [v[0] if isinstance(v, tuple) else v
                                                                          for v in items]


@pytest.mark.parametrize("items, error, fragments", [
    ([], ValueError, ["at least one record"]),
    ([{"path": "a", "label": 1}, {"path": "b", "label": None}], ValueError, ["record 1 field 'label' is None"]),
    ([1, None], ValueError, ["record 1 is None"]),
    ([{"a": 1}, {"a": 2}, {"b": 1}], ValueError, ["record 2", "missing ['a']", "extra ['b']"]),
    ([{"a": 1}, {"a": 1, "b": 2}], ValueError, ["record 1", "missing []", "extra ['b']"]),
    ([{"a": 1}, (1,)], TypeError, ["record 1 is a tuple", "record 0 is a dict"]),
    ([(1, 2), (1, 2), (1,)], ValueError, ["record 2 is a tuple of 1", "tuple of 2"]),
    ([{"a": "x"}, {"a": "y"}, {"a": 2}], TypeError, ["record 2 field 'a' is a number", "record 0 field 'a' is str"]),
    ([{"a": True}, {"a": 2}], TypeError, ["record 1 field 'a' is a number", "record 0 field 'a' is bool"]),
    ([(1, [2])], TypeError, ["record 0 item 1 is a list"]),
    ([{"a": 1}, {"a": {"nested": 1}}], TypeError, ["record 1 field 'a' is a dict"]),
    ([{1: "x"}], TypeError, ["key 1", "str keys"]),
    ([{"a": 1}, {"a": 2**64}], OverflowError, ["record 1 field 'a' is 18446744073709551616", "64-bit"]),
    ([{"a": -1}, {"a": 2**63}], OverflowError, ["record 1 field 'a' is 9223372036854775808", "64-bit"]),
    ([{"a": 1.5}, {"a": 2**70}], OverflowError, ["record 1 field 'a' is 1180591620717411303424"]),
    ([{}], ValueError, ["empty dict"]),
])
def test_errors_name_the_record_and_field(items, error, fragments):
    with pytest.raises(error) as info:
        Records(items)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_index_and_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        Records([1], shm_dir=str(tmp_path / "missing"))
    with Records(meta(3)) as records:
        for bad in (3, -4):
            with pytest.raises(IndexError, match=f"record index {bad} out of range for 3 records"):
                records[bad]
        with pytest.raises(TypeError, match="integers or slices, not str"):
            records["path"]
        with pytest.raises(KeyError, match="no column 'nope'"):
            records.column("nope")
    for use in (lambda: records[0], lambda: list(records), lambda: records.column("label"),
                lambda: pickle.dumps(records)):
        with pytest.raises(ValueError, match="closed"):
            use()
    records.close()  # twice is fine


def test_negative_indices_slices_and_views():
    items = meta(20)
    with Records(items) as records:
        assert [records[i] for i in range(-20, 20)] == [items[i] for i in range(-20, 20)]
        assert records[np.int64(-1)] == items[-1]
        for s in (slice(None), slice(3, 11), slice(None, None, -1), slice(15, 2, -3), slice(-5, None),
                  slice(100, 200), slice(2, 18, 4), slice(None, None, -7)):
            view = records[s]
            assert isinstance(view, Records) and list(view) == items[s] and len(view) == len(items[s])
            assert view.column("label").tolist() == [r["label"] for r in items[s]]
            assert view.column("path") == [r["path"] for r in items[s]]
            assert list(view[::-2][1:]) == items[s][::-2][1:]  # views of views
            if len(view):
                assert view[-1] == items[s][-1]
        assert list(reversed(records)) == items[::-1] and items[7] in records and records.index(items[7]) == 7
        view = records[5:]
        assert view.nbytes == records.nbytes and view.columns == records.columns
        assert np.shares_memory(view.column("label"), records.column("label"))  # no copy
    with pytest.raises(ValueError, match="closed"):
        view[0]  # closing the records closes its views


# --------------------------------------------------------------------------- pickling
@pytest.mark.parametrize("dumps, loads", [(pickle.dumps, pickle.loads), (dill.dumps, dill.loads)])
def test_pickle_sends_an_address_not_the_data(dumps, loads):
    small, large = Records(meta(10)), Records(meta(100_000))
    try:
        sizes = [len(dumps(r)) for r in (small, large, large[::-3])]
        assert max(sizes) < 300 and max(sizes) - min(sizes) < 20, sizes  # independent of the size
        copy = loads(dumps(large[10::-3]))
        assert list(copy) == meta(100_000)[10::-3]
        copy = loads(dumps(large))
        assert copy[99_999] == {"path": "/data/images/0099999.jpg", "label": 999}
        assert len(mappings(file_of(large))) == 2  # the same file, mapped twice: no copy
        copy.close()
    finally:
        small.close()
        large.close()


def test_unpickling_after_the_owner_closed_fails_clearly():
    records = Records(meta(5))
    blob = pickle.dumps(records)
    records.close()
    other = Records(["reuses the descriptor number"])  # the same fd number, another file
    try:
        with pytest.raises(RuntimeError, match="are gone"):
            pickle.loads(blob)
    finally:
        other.close()


# --------------------------------------------------------------------------- workers
@pytest.mark.parametrize("workers, start_method", [(0, "forkserver"), (2, "forkserver"), (2, "fork")])
def test_workers_read_the_records_through_a_loader(workers, start_method):
    n = 20_000
    with Records(meta(n)) as records, Loader(records, path_and_label, batch_size=500, workers=workers,
                                             start_method=start_method, shuffle=True) as loader:
        seen = []
        for paths, labels in loader:
            seen += zip(paths, labels.tolist(), strict=True)
        assert sorted(seen) == [(r["path"], r["label"]) for r in meta(n)]
        name = file_of(records)
        for pid in loader.worker_pids:  # each worker maps the parent's file: zero copy
            assert maps_of(pid, name), f"worker {pid} does not map {name}"
        if start_method == "forkserver" and workers:
            # the dataset shipped to the workers is the address, not 20,000 records
            spec, = (fd for fd in segment_fds(loader_token(loader) + "spec"))
            assert os.fstat(spec).st_size < 2000


def test_workers_keep_their_mapping_after_the_owner_closes():
    records = Records(meta(1000))
    with Loader(records, path_and_label, batch_size=100, workers=2, start_method="forkserver") as loader:
        assert sum(len(paths) for paths, _ in loader) == 1000
        records.close()  # the workers mapped it already: the memory lives on for them
        labels = np.concatenate([labels for _, labels in loader])
        assert labels.tolist() == [i % 1000 for i in range(1000)]


# --------------------------------------------------------------------------- lifetime
def test_the_memory_has_no_name_and_goes_with_its_last_user():
    records = Records(meta(1000))
    name = file_of(records)  # anonymous shared memory, named for /proc/<pid>/maps and lsof only
    assert name.startswith(f"/memfd:procpipe-{os.getpid()}-") and name.endswith("-records (deleted)")
    assert not our_shm_files()
    prefix = name.removesuffix(" (deleted)")
    labels = records[10:20].column("label")  # a live array keeps the mapping
    assert mappings(prefix)
    records.close()
    assert labels.tolist() == list(range(10, 20)) and mappings(prefix)
    del labels
    gc.collect()
    assert not mappings(prefix) and not _fds_to(prefix)

    records = Records(meta(10))  # garbage collection releases it too
    prefix = file_of(records).removesuffix(" (deleted)")
    view = records[2:4]
    del records
    gc.collect()
    assert mappings(prefix) and list(view) == meta(10)[2:4]  # a view keeps it alive
    del view
    gc.collect()
    assert not mappings(prefix) and not _fds_to(prefix)


def _fds_to(prefix):
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(prefix):
                fds.append(fd)
        except OSError:
            pass
    return fds


OWNER = textwrap.dedent("""
    import os, sys
    import procpipe

    def first(record):
        return record["label"]

    if __name__ == "__main__":
        records = procpipe.Records([{"path": f"p{i}", "label": i} for i in range(1000)])
        loader = procpipe.Loader(records, first, batch_size=10, workers=2, start_method=sys.argv[1])
        assert [x for batch in loader for x in batch.tolist()] == list(range(1000))  # every worker mapped it
        print(os.readlink(f"/proc/self/fd/{records._store.where[2]}"), *loader.worker_pids, flush=True)
        sys.stdin.read()  # until killed
""")


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_sigkilled_owner_leaves_no_file_and_no_mapping(tmp_path, start_method):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    proc = subprocess.Popen([sys.executable, str(script), start_method], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env())
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(60), "the owner printed nothing in 60 s"
        line = proc.stdout.readline().split()
        assert len(line) == 4, (line, proc.stderr.read() if proc.poll() is not None else "")
        name, workers = line[0], [int(p) for p in line[2:]]
        assert line[1] == "(deleted)" and not os.path.exists(name)
        assert all(maps_of(pid, name) for pid in workers)
        tree = {proc.pid, *workers}
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        assert wait_gone(tree, 15) == [], "workers outlived their SIGKILLed owner"
        wait_until(lambda: not our_shm_files(pid=proc.pid), 15, "removal of the owner's loader files")
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"procpipe-{proc.pid}-")]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


# --------------------------------------------------------------------------- save / load
def test_save_and_load(tmp_path):
    items = meta(1000)
    path = str(tmp_path / "meta.records")
    with Records(items) as records:
        records.save(path)
        records[::-7].save(path + ".view")
    assert sorted(os.listdir(tmp_path)) == ["meta.records", "meta.records.view"]  # no temporary file left
    loaded = Records.load(path)
    assert list(loaded) == items and list(Records.load(path + ".view")) == items[::-7]
    blob = pickle.dumps(loaded[5:])
    assert len(blob) < 300 and list(pickle.loads(blob)) == items[5:]
    with Loader(loaded, path_and_label, batch_size=100, workers=2, start_method="forkserver") as loader:
        assert [label for _, labels in loader for label in labels.tolist()] == [i % 1000 for i in range(1000)]
    loaded.close()
    assert os.path.exists(path)  # a saved file is yours: never removed
    (tmp_path / "junk").write_bytes(b"not records at all")
    with pytest.raises(ValueError, match="not a procpipe.Records file"):
        Records.load(str(tmp_path / "junk"))
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ValueError, match="not a procpipe.Records file"):
        Records.load(str(tmp_path / "empty"))


def test_loader_over_records_matches_a_loader_over_the_list():
    items = meta(3000)
    def epoch(source):
        with Loader(source, batch_size=256, workers=0, shuffle=True, seed=3) as loader:
            return [(b["path"], b["label"].tolist()) for b in loader]

    with Records(items) as records:
        assert epoch(records) == epoch(items)
    assert procpipe.Records is Records
