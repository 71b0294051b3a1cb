"""``python -m procpipe.bench.readers``: records/s of each ``procpipe.readers`` reader against
the format's own reader, on the same local file, in one process (no Loader, no workers).

- tfrecord: ``readers.tfrecord()`` (bytes, both checksums checked) vs TensorFlow's
  ``tf.data.TFRecordDataset`` iterated eagerly (where TensorFlow is importable; ``n/a``
  elsewhere). tfrecord-example: ``readers.tfrecord(parse=True)`` (bytes to a dict of numpy
  arrays) vs ``TFRecordDataset`` + ``tf.train.Example.FromString`` per record.
- parquet: ``readers.parquet()`` (a dict per row) vs pyarrow's ``ParquetFile.iter_batches``
  + ``to_pylist`` (the same rows as dicts).
- webdataset: ``readers.webdataset()`` vs ``webdataset.WebDataset`` (undecoded samples).
- jsonl: ``readers.jsonl()`` vs ``json.loads`` per line of ``open()``.

Each pair is timed ``--repeat`` times, alternating, and the best run is kept (a shared
machine's noise only ever slows a run down).
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np


def _rate(make: Callable[[], Iterable[Any]]) -> tuple[float, int]:
    started = time.perf_counter()
    n = sum(1 for _ in make())
    return n / (time.perf_counter() - started), n


def _write_files(folder: str, records: int, size: int) -> dict[str, str]:
    from procpipe import readers

    rng = np.random.default_rng(0)
    paths = {}
    payloads = [rng.bytes(size) for _ in range(min(records, 256))]
    paths["tfrecord"] = os.path.join(folder, "a.tfrecord")
    with open(paths["tfrecord"], "wb") as f:
        for i in range(records):
            f.write(readers.frame(payloads[i % len(payloads)]))
    paths["tfrecord-example"] = os.path.join(folder, "e.tfrecord")
    with open(paths["tfrecord-example"], "wb") as f:
        for i in range(records):
            f.write(
                readers.frame(
                    readers.make_example(
                        {"label": [i], "x": np.arange(16, dtype=np.float32), "data": payloads[i % len(payloads)]}
                    )
                )
            )
    paths["jsonl"] = os.path.join(folder, "a.jsonl")
    with open(paths["jsonl"], "w") as f:
        for i in range(records):
            f.write(json.dumps({"id": i, "text": "word " * (size // 5), "score": i / 3}) + "\n")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        paths["parquet"] = os.path.join(folder, "a.parquet")
        pq.write_table(
            pa.table(
                {"id": np.arange(records), "score": np.arange(records) / 3, "text": ["word " * (size // 5)] * records}
            ),
            paths["parquet"],
            row_group_size=8192,
        )
    except ImportError:
        pass
    paths["webdataset"] = os.path.join(folder, "a.tar")
    with tarfile.open(paths["webdataset"], "w") as tar:
        for i in range(records):
            for ext, data in (("bin", payloads[i % len(payloads)]), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{i:08d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return paths


def _theirs(fmt: str, path: str) -> Callable[[], Iterable[Any]] | None:
    """The format's own reader of ``path``, or None where its package is missing."""
    try:
        if fmt == "tfrecord":
            import tensorflow as tf

            return lambda: (r.numpy() for r in tf.data.TFRecordDataset(path))
        if fmt == "tfrecord-example":
            import tensorflow as tf

            parse = tf.train.Example.FromString
            return lambda: (parse(r.numpy()) for r in tf.data.TFRecordDataset(path))
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return lambda: (row for b in pq.ParquetFile(path).iter_batches() for row in b.to_pylist())
        if fmt == "webdataset":
            import webdataset as wds

            return lambda: wds.WebDataset(path, shardshuffle=False)
        if fmt == "jsonl":

            def lines() -> Iterable[Any]:
                with open(path) as f:
                    for line in f:
                        yield json.loads(line)

            return lines
    except ImportError:
        return None
    return None


def measure(records: int = 50_000, size: int = 256, repeat: int = 3) -> list[dict[str, Any]]:
    """One row per format: procpipe's records/s, the format's own reader's, and their ratio."""
    from procpipe import readers

    rows = []
    with tempfile.TemporaryDirectory(prefix="procpipe-bench-readers-") as folder:
        paths = _write_files(folder, records, size)
        makers: dict[str, Callable[[], Any]] = {
            "tfrecord": readers.tfrecord,
            "tfrecord-example": lambda: readers.tfrecord(parse=True),
            "jsonl": readers.jsonl,
            "parquet": readers.parquet,
            "webdataset": readers.webdataset,
        }
        ours: dict[str, Any] = {}
        for fmt, make in makers.items():
            try:
                ours[fmt] = make()
            except ImportError:  # (its package is missing here: no row)
                pass
        for fmt, path in paths.items():
            if fmt not in ours:
                continue
            theirs = _theirs(fmt, path)
            best_ours, best_theirs = 0.0, 0.0
            for _ in range(repeat):
                rate, n = _rate(functools.partial(ours[fmt], path))
                assert n == records, (fmt, n)
                best_ours = max(best_ours, rate)
                if theirs is not None:
                    best_theirs = max(best_theirs, _rate(theirs)[0])
            rows.append(
                {
                    "format": fmt,
                    "records": records,
                    "procpipe_per_s": best_ours,
                    "theirs_per_s": best_theirs or None,
                    "ratio": best_ours / best_theirs if best_theirs else None,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m procpipe.bench.readers", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=256, help="payload bytes per record")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{'format':18} {'procpipe rec/s':>15} {'own reader rec/s':>17} {'ratio':>6}")
    for row in measure(args.records, args.size, args.repeat):
        theirs = "n/a" if row["theirs_per_s"] is None else f"{row['theirs_per_s']:,.0f}"
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
        print(f"{row['format']:18} {row['procpipe_per_s']:>15,.0f} {theirs:>17} {ratio:>6}")


if __name__ == "__main__":
    main()
