"""procpipe.readers on local files: each reader against data written by the format's own library.

TFRecord: bytes built with the documented framing (always), and files written by TensorFlow
(where it is importable); Parquet: written by pyarrow; WebDataset: by the ``webdataset``
package's ``TarWriter`` and by ``tarfile`` in its layout; JSON Lines: by ``json``. S3 is in
test_readers_s3.py.
"""
from __future__ import annotations

import io
import json
import struct
import tarfile

import numpy as np
import pytest

from conftest import run_python

pytest.importorskip("fsspec", reason="procpipe.readers needs fsspec (pip install 'procpipe[readers]')")
pytest.importorskip("google_crc32c", reason="the tfrecord reader needs google-crc32c (pip install 'procpipe[readers]')")

from procpipe import Loader, Shards, readers  # noqa: E402
from procpipe.readers import ReadError  # noqa: E402


# --------------------------------------------------------------------------- tfrecord
def _framed(records: list[bytes]) -> bytes:
    """TFRecord framing written out by hand from the format's documentation (CRC-32C
    masked), independently of procpipe.readers.frame."""
    import google_crc32c

    def masked(data: bytes) -> int:
        crc = google_crc32c.value(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    out = bytearray()
    for record in records:
        header = struct.pack("<Q", len(record))
        out += header + struct.pack("<I", masked(header)) + record + struct.pack("<I", masked(record))
    return bytes(out)


def test_tfrecord_reads_documented_framing(tmp_path):
    records = [b"", b"x", bytes(range(256)) * 40] + [f"record {i}".encode() for i in range(50)]
    path = tmp_path / "a.tfrecord"
    path.write_bytes(_framed(records))
    assert list(readers.tfrecord()(str(path))) == records
    assert readers.frame(b"abc") == _framed([b"abc"])  # procpipe's writer agrees with the spec


@pytest.mark.parametrize("where, what", [(3 * 16 + 3 + 12 + 2, "data's checksum"), (3 * 16 + 3 + 1, "length's checksum"),
                                         (-2, "truncated")])
def test_tfrecord_corrupt_record_names_file_and_offset(tmp_path, where, what):
    data = bytearray(_framed([b"a", b"b", b"c", b"hello", b"world"]))
    offset = 3 * 16 + 3  # record 3 starts after three 1-byte records
    if where < 0:
        data = data[:where]
        offset = 3 * 16 + 3 + 16 + 5  # the last record (4) is cut
    else:
        data[where] ^= 0xFF
    path = tmp_path / "bad.tfrecord"
    path.write_bytes(bytes(data))
    reader = readers.tfrecord()(str(path))
    with pytest.raises(ReadError) as info:
        list(reader)
    message = str(info.value)
    assert str(path) in message and f"at byte {offset}" in message and what in message
    assert info.value.offset == offset and info.value.url == str(path)


def test_tfrecord_parses_examples_into_numpy(tmp_path):
    examples = [readers.make_example({"label": [i], "x": np.arange(3, dtype=np.float32) + i,
                                      "name": f"n{i}".encode()}) for i in range(4)]
    path = tmp_path / "e.tfrecord"
    path.write_bytes(_framed(examples))
    parsed = list(readers.tfrecord(parse=True)(str(path)))
    assert [p["label"].tolist() for p in parsed] == [[0], [1], [2], [3]]
    assert parsed[2]["x"].dtype == np.float32 and parsed[2]["x"].tolist() == [2, 3, 4]
    assert parsed[1]["name"] == [b"n1"]


def test_tfrecord_written_by_tensorflow(tmp_path):
    tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed here (its own writer is the reference; pip install procpipe[tf])")
    path = str(tmp_path / "tf.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for i in range(20):
            feature = {"label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i, -i])),
                       "x": tf.train.Feature(float_list=tf.train.FloatList(value=[i / 2, 1.5])),
                       "s": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"s%d" % i]))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    raw = list(readers.tfrecord()(path))
    assert raw == [r.numpy() for r in tf.data.TFRecordDataset(path)]
    parsed = list(readers.tfrecord(parse=True)(path))
    assert [p["label"].tolist() for p in parsed] == [[i, -i] for i in range(20)]
    assert [p["x"].tolist() for p in parsed] == [[i / 2, 1.5] for i in range(20)]
    assert [p["s"] for p in parsed] == [[b"s%d" % i] for i in range(20)]
    # and TensorFlow parses what make_example wrote
    spec = {"v": tf.io.FixedLenFeature([2], tf.int64)}
    assert tf.io.parse_single_example(readers.make_example({"v": [7, 8]}), spec)["v"].numpy().tolist() == [7, 8]


# --------------------------------------------------------------------------- parquet
def test_parquet_written_by_pyarrow_row_groups(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="the parquet reader needs pyarrow (pip install procpipe[readers])")
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(25)), "text": [f"t{i}" for i in range(25)],
                      "vec": [[float(i), 0.5] for i in range(25)]})
    path = str(tmp_path / "a.parquet")
    pq.write_table(table, path, row_group_size=7)
    assert pq.ParquetFile(path).num_row_groups == 4
    rows = list(readers.parquet()(path))
    assert rows == table.to_pylist()
    assert list(readers.parquet(columns=["id"])(path)) == [{"id": i} for i in range(25)]
    assert readers.parquet().lengths([path, path]) == [25, 25]


# --------------------------------------------------------------------------- webdataset
def test_webdataset_written_by_tarwriter(tmp_path):
    wds = pytest.importorskip("webdataset", reason="the webdataset package (its TarWriter) is not installed")
    path = str(tmp_path / "shard-000.tar")
    with wds.TarWriter(path) as sink:
        for i in range(10):
            sink.write({"__key__": f"sample{i:04d}", "txt": f"text {i}", "cls": i, "seg.png": b"\x89PNG" + bytes([i])})
    samples = list(readers.webdataset()(path))
    assert [s["__key__"] for s in samples] == [f"sample{i:04d}" for i in range(10)]
    assert samples[3]["txt"] == b"text 3" and samples[3]["cls"] == b"3" and samples[3]["seg.png"] == b"\x89PNG\x03"
    assert samples[0]["__url__"] == path
    # the same grouping as webdataset's own reader
    theirs = list(wds.WebDataset(path, shardshuffle=False))
    assert [{k: v for k, v in s.items() if not k.startswith("__")} for s in samples] == \
        [{k: v for k, v in s.items() if not k.startswith("__")} for s in theirs]


def test_webdataset_tarfile_layout_gzip_and_directories(tmp_path):
    path = str(tmp_path / "shard.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for key, ext, data in [("a/x", "jpg", b"1"), ("a/x", "json", b"{}"), ("a/y", "jpg", b"2"),
                               ("b/x", "jpg", b"3")]:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    samples = list(readers.webdataset()(path))
    assert [(s["__key__"], sorted(k for k in s if not k.startswith("__"))) for s in samples] == \
        [("a/x", ["jpg", "json"]), ("a/y", ["jpg"]), ("b/x", ["jpg"])]
    (tmp_path / "junk.tar").write_bytes(b"not a tar" * 100)
    with pytest.raises(ReadError, match="junk.tar"):
        list(readers.webdataset()(str(tmp_path / "junk.tar")))


# --------------------------------------------------------------------------- jsonl
def test_jsonl(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"i": i, "s": "é" * i}) + "\n" for i in range(5)) + "\n  \n")
    assert list(readers.jsonl()(str(path))) == [{"i": i, "s": "é" * i} for i in range(5)]
    path.write_text('{"i": 0}\n{"i": \n')
    with pytest.raises(ReadError, match=r"line 2 of .*a.jsonl is not valid JSON"):
        list(readers.jsonl()(str(path)))


# --------------------------------------------------------------------------- through a Loader
def test_readers_as_open_fn_in_workers(tmp_path):
    paths = []
    for s in range(3):
        path = tmp_path / f"s{s}.tfrecord"
        path.write_bytes(_framed([readers.make_example({"v": [s * 100 + r]}) for r in range(7)]))
        paths.append(str(path))
    shards = Shards(paths, readers.tfrecord(parse=True), lengths=[7, 7, 7])
    loader = Loader(shards, fn=lambda e: e["v"][0], batch_size=4, workers=2, seed=0)
    seen = sorted(int(v) for batch in loader for v in batch)
    assert seen == sorted(s * 100 + r for s in range(3) for r in range(7))


def test_reader_options_checked_where_built():
    with pytest.raises(ValueError, match="retries must be an int >= 0"):
        readers.jsonl(retries=-1)
    with pytest.raises(ValueError, match="read_ahead must be an int >= 1"):
        readers.tfrecord(read_ahead=0)
    with pytest.raises(TypeError, match="columns must be a list"):
        readers.parquet(columns="id")
    with pytest.raises(FileNotFoundError):
        list(readers.jsonl()("/nonexistent/procpipe-readers.jsonl"))


def test_import_procpipe_imports_no_reader_dependency():
    out = run_python(["-c", "import sys, procpipe; print(sorted(m for m in sys.modules if m.split('.')[0] in "
                      "('procpipe', 'fsspec', 'pyarrow', 'google', 'google_crc32c', 's3fs', 'webdataset')))"])
    loaded = eval(out.stdout.strip().splitlines()[-1])
    assert "procpipe" in loaded
    assert [m for m in loaded if not m.startswith("procpipe")] == []
    assert not any(m.startswith("procpipe.readers") for m in loaded)


def test_read_ahead_is_bounded(tmp_path):
    """A reader pulls its shard read_ahead bytes at a time: after the first record of a 1 MB
    file, no more than one refill beyond it has been read."""
    path = tmp_path / "big.tfrecord"
    path.write_bytes(_framed([bytes([i % 256]) * 1000 for i in range(1000)]))
    reader = readers.tfrecord(read_ahead=4096)
    file = reader.open(str(path))
    try:
        records = reader.records(file, str(path))
        assert next(records) == bytes(1000)
        assert 1016 <= file.raw.tell() <= 2 * 4096
        assert sum(1 for _ in records) == 999
    finally:
        file.close()
