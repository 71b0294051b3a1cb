"""procpipe.readers over S3: a real S3-compatible server (moto's server mode) on 127.0.0.1,
started by these tests; the client is the real one (s3fs / botocore), never a mock.

The server is stopped mid-read (its listening socket closed: connections are refused):
the reader retries, and either succeeds when the server is back, or raises a clear error.
"""
from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("s3fs", reason="S3 tests need s3fs (pip install 'procpipe[test]')")
pytest.importorskip("google_crc32c", reason="the tfrecord reader needs google-crc32c (pip install 'procpipe[readers]')")
moto_server = pytest.importorskip("moto.server", reason="S3 tests need moto's server mode (pip install 'moto[server]')")

from procpipe import Loader, Shards, readers  # noqa: E402
from procpipe.readers import ReadError  # noqa: E402

RECORD = 1 << 16  # 64 KiB records; read_ahead is one record, so each record is its own request
RECORDS = 24


def _options(endpoint: str) -> dict:
    return {"key": "testing", "secret": "testing", "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5}}


class _Server:
    """moto's threaded S3 server on 127.0.0.1 (never another address); stop() also closes
    the listening socket, so that a client's next connection is refused at once."""

    def __init__(self, port: int = 0) -> None:
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.server.stop()
            self.server._server.server_close()  # (moto's, third-party: stop() leaves the socket listening)


@pytest.fixture
def s3(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retries (with sleeps): ours are tested
    server = _Server()
    options = _options(f"http://127.0.0.1:{server.port}")
    fs = s3fs.S3FileSystem(**options)
    fs.call_s3("create_bucket", Bucket="data")
    yield server, fs, options
    server.stop()


def _records() -> list[bytes]:
    return [bytes([i]) * RECORD for i in range(RECORDS)]


def test_s3_readers_through_local_server(s3, tmp_path):
    pa = pytest.importorskip("pyarrow", reason="the parquet reader needs pyarrow (pip install procpipe[readers])")
    import pyarrow.parquet as pq

    server, fs, options = s3
    fs.pipe("data/a.tfrecord", b"".join(readers.frame(r) for r in _records()))
    fs.pipe("data/b.jsonl", "".join(json.dumps({"i": i}) + "\n" for i in range(100)).encode())
    local = str(tmp_path / "c.parquet")
    pq.write_table(pa.table({"i": list(range(50))}), local, row_group_size=8)
    fs.put(local, "data/c.parquet")
    assert list(readers.tfrecord(read_ahead=RECORD, storage_options=options)("s3://data/a.tfrecord")) == _records()
    assert list(readers.jsonl(storage_options=options)("s3://data/b.jsonl")) == [{"i": i} for i in range(100)]
    parquet = readers.parquet(storage_options=options)
    assert list(parquet("s3://data/c.parquet")) == [{"i": i} for i in range(50)]
    assert parquet.lengths(["s3://data/c.parquet"]) == [50]
    # and in worker processes, through a Loader
    shards = Shards(["s3://data/b.jsonl", "s3://data/b.jsonl"], readers.jsonl(storage_options=options))
    loader = Loader(shards, fn=lambda r: r["i"], batch_size=10, workers=2, seed=0)
    assert sorted(int(v) for batch in loader for v in batch) == sorted(list(range(100)) * 2)


def test_s3_server_killed_mid_read_retries_then_reads_on(s3, caplog):
    server, fs, options = s3
    fs.pipe("data/a.tfrecord", b"".join(readers.frame(r) for r in _records()))
    reader = readers.tfrecord(read_ahead=RECORD, retries=3, storage_options=options)("s3://data/a.tfrecord")
    got = [next(reader), next(reader)]
    port = server.port
    server.stop()
    restarted = []

    class Restart(logging.Handler):
        """On the reader's first retry warning, the server comes back on the same port (its
        buckets live in this process, so the object is still there)."""

        def emit(self, record: logging.LogRecord) -> None:
            if not restarted:
                restarted.append(_Server(port))

    handler = Restart(level=logging.WARNING)
    logging.getLogger("procpipe.readers").addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="procpipe.readers"):
            got += list(reader)
    finally:
        logging.getLogger("procpipe.readers").removeHandler(handler)
        for again in restarted:
            again.stop()
    assert restarted, "the reader never retried"
    assert got == _records()
    warnings = [r.getMessage() for r in caplog.records if r.name == "procpipe.readers"]
    assert len(warnings) == 1 and "s3://data/a.tfrecord" in warnings[0] and "attempt 2 of 4" in warnings[0]


def test_s3_server_killed_mid_read_is_a_clear_error_after_the_retries(s3, caplog):
    server, fs, options = s3
    fs.pipe("data/a.tfrecord", b"".join(readers.frame(r) for r in _records()))
    reader = readers.tfrecord(read_ahead=RECORD, retries=1, storage_options=options)("s3://data/a.tfrecord")
    assert next(reader) == _records()[0]
    server.stop()
    with caplog.at_level(logging.WARNING, logger="procpipe.readers"), pytest.raises(ReadError) as info:
        list(reader)
    message = str(info.value)
    assert "s3://data/a.tfrecord" in message and "failed 2 times (retries=1)" in message
    assert "Check that the storage is reachable" in message and info.value.offset > 0
    assert len([r for r in caplog.records if r.name == "procpipe.readers"]) == 1  # one retry, then the error
