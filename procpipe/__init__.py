"""procpipe: a multiprocess data loader for arbitrary Python preprocessing.

Workers run your own Python on your own dataset and collate numpy batches straight into
a preallocated shared-memory ring; the consumer receives zero-copy views, in order or
first-finished first. See README.md for the guarantees.
"""

import importlib as _importlib
from typing import TYPE_CHECKING

# First: it counts the threads importing numpy starts (its BLAS pool), the only native threads
# start_method="auto" treats as safe to fork beside (procpipe.worker.fork_safety).
from .worker import fork_safety as _fork_safety  # noqa: F401
from .worker import zygote as _zygote
from .errors import (
    CacheError,
    CollateError,
    ProcpipeError,
    RemoteTraceback,
    ShardLengthError,
    SharedMemoryError,
    ShippingError,
    TaskTimeoutError,
    WorkerError,
)
from .core.rng import batch_rng, sample_rng

if TYPE_CHECKING:
    from .api.elastic import combine_states
    from .engine.autotune import AutoWorkers
    from .loader import Loader
    from .plan.mix import Mix
    from .streaming import Shards
    from .worker.records import Records

# The rest of the API is imported when first used (PEP 562): a worker started from a
# forkserver imports this package for its own modules, and needs none of the engine
# (~0.15 s less before the first batch: docs/guide/startup.md).
_LAZY = {
    "AutoWorkers": "engine.autotune",
    "Loader": "loader",
    "Mix": "plan.mix",
    "Records": "worker.records",
    "Shards": "streaming",
    "combine_states": "api.elastic",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'procpipe' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) - {"TYPE_CHECKING"} | set(_LAZY))


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
    "ShippingError",
    "TaskTimeoutError",
    "WorkerError",
    "batch_rng",
    "combine_states",
    "sample_rng",
]
__version__ = "0.1.0"

# Last, while the process is still safe to fork: the zygote that later workers are forked
# from when it no longer is (a thread of the program runs; procpipe.worker.zygote).
_zygote.start()
