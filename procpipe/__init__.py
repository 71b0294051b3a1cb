"""procpipe: a multiprocess data loader for arbitrary Python preprocessing.

Workers run your own Python on your own dataset and collate numpy batches straight into
a preallocated shared-memory ring; the consumer receives zero-copy views, in order or
first-finished first. See README.md for the guarantees.
"""

import importlib as _importlib
from typing import TYPE_CHECKING

# First: it counts the threads importing numpy starts (its BLAS pool), the only native threads
# start_method="auto" treats as safe to fork beside (procpipe._worker.fork_safety).
from ._worker import fork_safety as _fork_safety  # noqa: F401
from ._worker import zygote as _zygote
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
from ._core.rng import batch_rng, sample_rng
from ._core.version import __version__ as __version__  # one definition, read by the package metadata too

if TYPE_CHECKING:
    from ._sources.combine import combine_states
    from .config import AutoWorkers
    from .loader import Loader
    from ._sources.mix.mixture import Mix
    from ._sources.stream import Shards
    from ._worker.records import Records

# The rest of the API is imported when first used (PEP 562): a worker started from a
# forkserver imports this package for its own modules, and needs none of the engine
# (~0.15 s less before the first batch: docs/guide/startup.md).
_LAZY = {
    "AutoWorkers": "config",
    "Loader": "loader",
    "Mix": "_sources.mix.mixture",
    "Records": "_worker.records",
    "Shards": "_sources.stream",
    "combine_states": "_sources.combine",
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

# Last, while the process is still safe to fork: the zygote that later workers are forked
# from when it no longer is (a thread of the program runs; procpipe._worker.zygote).
_zygote.start()
