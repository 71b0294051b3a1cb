"""Readers for the formats training data lives in, each an ``open_fn`` for ``procpipe.Shards``.

```python
from procpipe import Loader, Shards, readers

shards = Shards(["s3://bucket/train-00000.tfrecord", ...], readers.tfrecord(parse=True))
loader = Loader(shards, fn=..., batch_size=64, workers=8)
```

- ``tfrecord``: TFRecord files, checksums checked; ``parse=True`` parses ``tf.train.Example``
  into numpy (``parse_example``) without TensorFlow.
- ``webdataset``: WebDataset tar shards, members grouped into samples by key.
- ``parquet``: Parquet files, one row group at a time through pyarrow.
- ``jsonl``: JSON Lines.

Every shard is a path or URL opened through fsspec (local, ``s3://``, ``gs://``,
``http(s)://``, ...) with retries and a bounded read-ahead (``open_url``). The packages
they need (fsspec, pyarrow, google-crc32c, protobuf; s3fs / gcsfs for object stores) are
the ``readers`` extra: ``pip install 'procpipe[readers]'``. ``import procpipe`` imports
neither this package nor any of them; ``import procpipe.readers`` imports only the standard
library and numpy (each dependency is imported where it is first needed).
"""

from .example import make_example, parse_example
from .io import Reader, ReadError, RetryingFile, open_url
from .jsonl import Jsonl, jsonl
from .parquet import Parquet, parquet
from .tfrecord import TFRecord, frame, masked_crc, tfrecord
from .webdataset import WebDataset, split_key, webdataset

__all__ = [
    "Jsonl",
    "Parquet",
    "ReadError",
    "Reader",
    "RetryingFile",
    "TFRecord",
    "WebDataset",
    "frame",
    "jsonl",
    "make_example",
    "masked_crc",
    "open_url",
    "parquet",
    "parse_example",
    "split_key",
    "tfrecord",
    "webdataset",
]
