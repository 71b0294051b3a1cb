"""procpipe: a multiprocess data loader for arbitrary Python preprocessing.

Workers run your own Python on your own dataset and collate numpy batches straight into
a preallocated shared-memory ring; the consumer receives zero-copy views, in order or
first-finished first. See README.md for the guarantees.
"""
from .errors import (CollateError, ProcpipeError, RemoteTraceback, SharedMemoryError, TaskTimeoutError,
                     WorkerError)
from .loader import Loader
from .rng import sample_rng

__all__ = [
    "CollateError",
    "Loader",
    "ProcpipeError",
    "RemoteTraceback",
    "SharedMemoryError",
    "TaskTimeoutError",
    "WorkerError",
    "sample_rng",
]
__version__ = "0.1.0"
