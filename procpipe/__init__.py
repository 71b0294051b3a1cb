"""procpipe: a multiprocess data loader for arbitrary Python preprocessing.

Workers run your own Python on your own dataset and collate numpy batches straight into
a preallocated shared-memory ring; the consumer receives zero-copy views, in order or
first-finished first. See README.md for the guarantees.
"""
# First: it counts the threads importing numpy starts (its BLAS pool), the only native threads
# start_method="auto" treats as safe to fork beside (procpipe.worker.fork_safety).
from .worker import fork_safety as _fork_safety  # noqa: F401
from .errors import (CacheError, CollateError, ProcpipeError, RemoteTraceback, ShardLengthError, SharedMemoryError,
                     TaskTimeoutError, WorkerError)
from .engine.autotune import AutoWorkers
from .loader import Loader
from .worker.records import Records
from .streaming import Shards
from .core.rng import batch_rng, sample_rng

__all__ = [
    "AutoWorkers",
    "CacheError",
    "CollateError",
    "Loader",
    "ProcpipeError",
    "Records",
    "RemoteTraceback",
    "ShardLengthError",
    "SharedMemoryError",
    "Shards",
    "TaskTimeoutError",
    "WorkerError",
    "batch_rng",
    "sample_rng",
]
__version__ = "0.1.0"
