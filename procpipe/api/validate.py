"""Checks of ``Loader``'s arguments, before anything starts.

``validate`` checks the arguments one by one (types, ranges, and the combinations that
make no sense, such as ``collate_fn`` without a ``batch_size``) and ``validate_epochs``
the epoch options, so that a mistake raises ``TypeError``/``ValueError`` naming the
argument in the calling process, before any worker starts. A streaming source's own
options are checked by ``streaming.StreamPlan``, the cache's layout by ``cache.open_cache``.
"""

from __future__ import annotations

import os
from typing import Any

from ..core.checks import check_int, is_count
from ..core.shm import check_private_dir
from ..engine.autotune import resolve as resolve_autotune
from ..worker.cache import validate as validate_cache

START_METHODS = ("auto", "forkserver", "spawn", "fork", "zygote")


def validate(
    source: Any,
    fn: Any,
    batch_size: Any,
    workers: Any,
    prefetch: Any,
    seed: Any,
    collate_fn: Any,
    start_method: Any,
    shm_dir: Any,
    slot_bytes: Any,
    max_worker_restarts: Any,
    *,
    batches: Any = None,
    shard: Any = None,
    shuffle: Any = False,
    drop_last: Any = False,
    on_error: Any = "raise",
    max_skipped: Any = 0.01,
    task_timeout: Any = None,
    speculate: Any = None,
    batch_fn: Any = None,
    cache: Any = None,
    augment: Any = None,
    device: Any = None,
    device_fn: Any = None,
) -> None:
    """Check ``Loader``'s arguments (all but the epoch options); raise on the first one wrong."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if isinstance(max_skipped, bool) or not (
        (isinstance(max_skipped, int) and max_skipped >= 0)
        or (isinstance(max_skipped, float) and 0.0 <= max_skipped <= 1.0)
    ):
        raise ValueError(
            f"max_skipped must be an int >= 0 (a count) or a float in [0, 1] (a fraction of the "
            f"epoch's samples), got {max_skipped!r}"
        )
    if task_timeout is not None and (
        isinstance(task_timeout, bool) or not isinstance(task_timeout, (int, float)) or not task_timeout > 0
    ):
        raise ValueError(f"task_timeout must be None or a number of seconds > 0, got {task_timeout!r}")
    if speculate is not None and (
        isinstance(speculate, bool) or not isinstance(speculate, (int, float)) or not speculate >= 1
    ):
        raise ValueError(
            f"speculate must be None or a number >= 1 (a multiple of the median batch time), got {speculate!r}"
        )
    for name, value in (("batch_fn", batch_fn), ("augment", augment), ("device_fn", device_fn)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
    if batch_fn is not None and batch_size is None:
        raise ValueError(
            "batch_fn needs a batch_size: with batch_size=None samples are yielded unbatched "
            "(apply the function in fn or augment instead)"
        )
    if device_fn is not None and device is None:
        raise ValueError(
            "device_fn runs on batches once they are on a device: pass device='cuda' (or 'cpu') "
            "with it, or transform batches in batch_fn (in the workers) instead"
        )
    validate_cache(cache)
    for name, value in (("fn", fn), ("collate_fn", collate_fn)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")
    check_int("batch_size", batch_size, 1, allow_none=True)
    if resolve_autotune(workers) is None:
        if isinstance(workers, str):
            raise ValueError(f"workers must be an int >= 0 or 'auto', got {workers!r}")
        check_int("workers", workers, 0)
    check_int("prefetch", prefetch, 1)
    check_int("seed", seed, 0)
    check_int("slot_bytes", slot_bytes, 1, allow_none=True)
    check_int("max_worker_restarts", max_worker_restarts, 0)
    if collate_fn is not None and batch_size is None:
        raise ValueError("collate_fn needs a batch_size: with batch_size=None samples are yielded unbatched")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    if not os.path.isdir(shm_dir) or not os.access(shm_dir, os.W_OK):
        raise ValueError(
            f"shm_dir={shm_dir!r} is not a writable directory; pass a directory procpipe can create files in"
        )
    check_private_dir(shm_dir, "shm_dir")
    if batches is not None:
        if not callable(batches):
            raise TypeError(f"batches must be a callable epoch -> list of index lists, got {type(batches).__name__}")
        if shuffle or drop_last or shard is not None:
            raise ValueError(
                "batches=... decides every epoch's batches itself: shuffle, drop_last and shard do not apply "
                "(leave them at their defaults and shuffle, drop or shard inside the callable)"
            )
    if shard is not None and (
        not isinstance(shard, (tuple, list))
        or len(shard) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in shard)
        or not (shard[1] >= 1 and 0 <= shard[0] < shard[1])
    ):
        raise ValueError(f"shard must be (rank, world_size) with 0 <= rank < world_size, got {shard!r}")


def validate_epochs(epochs: Any, reshuffle: Any, with_epoch: Any, batches: Any) -> None:
    """Check ``epochs``, ``reshuffle`` and ``with_epoch`` (and ``reshuffle`` against ``batches``)."""
    if epochs is not None and not is_count(epochs, 1):
        raise ValueError(f"epochs must be an int >= 1 or None (endless), got {epochs!r}")
    for name, value in (("reshuffle", reshuffle), ("with_epoch", with_epoch)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if batches is not None and not reshuffle:
        raise ValueError(
            "batches=... decides every epoch's batches itself: reshuffle does not apply "
            "(return the same batches for every epoch from the callable instead)"
        )


def validate_backend(backend: Any, workers: Any) -> None:
    """``backend``: None, or a remote backend (``procpipe.ray.Backend``) with a fixed worker count."""
    if backend is None:
        return
    if not (callable(getattr(backend, "pool", None)) and callable(getattr(backend, "lanes", None))):
        raise TypeError(f"backend must be None or a procpipe.ray.Backend(...), got {backend!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(
            f"with backend={type(backend).__name__}(...), workers is the number of worker processes per "
            f"node and must be an int >= 1 (workers=0 and workers='auto' run on this machine), got "
            f"{workers!r}"
        )
