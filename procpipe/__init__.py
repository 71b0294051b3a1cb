"""procpipe: a multiprocess data loader for arbitrary Python preprocessing.

Workers run your own Python on your own dataset and collate numpy batches straight into
a preallocated shared-memory ring; the consumer receives zero-copy views, in order or
first-finished first. See README.md for the guarantees.
"""
from .api.elastic import combine_states
from .core.rng import batch_rng, sample_rng
from .engine.autotune import AutoWorkers
from .errors import (
    CacheError,
    CollateError,
    ProcpipeError,
    RemoteTraceback,
    ShardLengthError,
    SharedMemoryError,
    TaskTimeoutError,
    WorkerError,
)
from .loader import Loader
from .plan.mix import Mix
from .streaming import Shards
from .worker.records import Records

__all__ = [
    "AutoWorkers",
    "CacheError",
    "CollateError",
    "Loader",
    "Mix",
    "ProcpipeError",
    "Records",
    "RemoteTraceback",
    "ShardLengthError",
    "Shards",
    "SharedMemoryError",
    "TaskTimeoutError",
    "WorkerError",
    "batch_rng",
    "combine_states",
    "sample_rng",
]
__version__ = "0.1.0"
