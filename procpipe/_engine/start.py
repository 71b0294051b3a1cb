"""Starting a Loader's engine, in the calling process: everything before the first worker runs.

``start_engine`` makes the loader's shared memory (``Segments``: anonymous, or files in
``shm_dir``), opens the cache (which computes the first sample), ships the user's objects to the
workers (pickled once, with cloudpickle or dill (``process.dump_spec``), into a sealed segment of
shared memory each worker receives as it starts; with ``"fork"`` they are inherited instead),
gets the multiprocess context (``context``: with ``"forkserver"``, the server is started
with the workers' environment and told to preload the modules the pickle references, in
the parent's import order: preload_list.py, preload.py) and starts the ``Coordinator``,
which starts the workers. If any step fails, everything made so far is released.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core.shm import Segments, SharedFd, proc_address, seal_writes, shipping
from .._worker.cache import prefix_of
from .._worker.preload_list import preload_list
from .._worker.process import ShippedSpec, WorkerSpec, dump_spec, dump_value
from .._worker.start_method import context as start_context
from .._worker.stream_cache import open_loader_cache
from ..config import EngineConfig
from ..errors import ShippingError
from .coordinator import Coordinator
from .pool import LocalPool


def start_engine(
    config: EngineConfig, spec: WorkerSpec, cache: Any, shm_dir: str | None, backend: Any = None
) -> Coordinator:
    """The coordinator of a loader with workers, its workers started (sets ``spec.cache``).

    ``shm_dir``: None for anonymous shared memory, else the directory of the ring's files.
    ``backend``: None for worker processes on this machine (``LocalPool``), or a remote
    backend (``procpipe.ray.Backend``) whose ``pool(spec, config, segments, cache)`` makes the pool.
    """
    segments = Segments(shm_dir)
    pool = None
    try:
        pool = (
            local_pool(config, spec, cache, segments)
            if backend is None
            else backend.pool(spec, config, segments, cache)
        )
        return Coordinator(config, pool, segments)
    except BaseException:
        if pool is not None:
            pool.close()
        segments.remove_all()
        raise


def local_pool(
    config: EngineConfig, spec: WorkerSpec, cache: Any, segments: Segments, own_session: bool = False
) -> LocalPool:
    """Worker processes on this machine: the cache (which runs the first sample here), the
    user's objects shipped to them (``own_session``: see ``process.worker_main``), and the
    start method's context (a forkserver preloads the modules the shipped objects reference)."""
    capacity = config.workers if config.autotune is None else max(config.autotune.hard_max, config.workers)
    spec.cache = open_loader_cache(spec, cache, segments, workers=True)
    # the named files a worker removes if this process is killed (anonymous memory needs nobody)
    leftovers = tuple(p for p in (segments.prefix, prefix_of(cache, segments)) if p is not None)
    if config.start_method == "fork":
        return LocalPool(start_context("fork"), spec, segments, leftovers, config.worker_env, capacity, own_session)
    data, fds = serialize_spec(spec, config.start_method)
    ctx = context(config.start_method, config.worker_env, segments, preload_list(data))
    shipped = ship_spec(data, fds, segments)
    return LocalPool(ctx, shipped, segments, leftovers, config.worker_env, capacity, own_session)


def context(start_method: str, env: dict[str, str], segments: Segments, preload: Sequence[str] = ()) -> Any:
    """The multiprocess context; a forkserver (if this starts it) preloads ``preload`` (preload.py)."""
    ctx = start_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["procpipe._worker.preload"])
        # The forkserver process inherits the environment when it starts: start it with
        # the workers' settings so libraries it preloads (numpy's BLAS) see them. The
        # module list goes in shared memory (it can be too long for an environment variable),
        # which the server, a child of this process, opens through /proc while the loader
        # holds it; a server that starts reads it before it forks the first worker. A server
        # that is already running (an earlier loader's) keeps what it preloaded.
        from multiprocess import forkserver

        listing = json.dumps({"sys_path": sys.path, "modules": list(preload)}).encode()
        fd = segments.new("preload", 0, "the forkserver's module list", "fewer modules", listing, anonymous=True)
        segments.hold(fd)
        address = ":".join(str(x) for x in proc_address(fd))
        server_env = dict(env, PROCPIPE_PRELOAD=address)
        saved = {k: os.environ.get(k) for k in server_env}
        os.environ.update(server_env)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return ctx


_INHERITED_ONLY = "through inheritance"  # multiprocessing's refusal to pickle Value, Array, Lock, Event...
_CULPRIT_DEPTH = 6  # how deep inside the user's objects the refusing attribute is looked for


def serialize_spec(spec: WorkerSpec, start_method: str) -> tuple[bytes, list[SharedFd]]:
    """The dataset, fn and collate_fn pickled (``process.dump_spec``) and the descriptors that go
    beside the pickle, or a ``ShippingError`` (a ``TypeError``) naming what refuses and why."""
    try:
        return dump_spec(spec)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises becomes a ShippingError naming it
        raise ShippingError(
            start_method,
            f"{type(exc).__name__}: {exc}",
            culprit=culprit(spec),
            inherited_only=_INHERITED_ONLY in str(exc),
        ) from None  # (the pickler's own traceback, dozens of its frames, says no more: it stays as __context__)


def culprit(spec: WorkerSpec) -> str:
    """The innermost attribute or item of the user's objects that refuses pickling, as an error
    names it (``"an attribute 'conn' holds a socket.socket"``), or "" if none is found."""
    for obj in (spec.source, spec.fn, spec.collate_fn, spec.batch_fn, spec.augment):
        if obj is None or _picklable(obj):
            continue
        found = _refusing(obj, _CULPRIT_DEPTH, set())
        if found is not None:
            name, value = found
            kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
            return f"an {name} holds a {kind}"
    return ""


def _parts_of(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"item {k!r}", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"item {i}", v) for i, v in enumerate(obj)]  # ("an item 3 holds ...")
    try:
        attributes = vars(obj)
    except TypeError:
        return []
    return [(f"attribute {k!r}", v) for k, v in attributes.items()]


def _refusing(obj: Any, depth: int, seen: set[int]) -> tuple[str, Any] | None:
    """The innermost ``(name, value)`` under ``obj`` (which refuses pickling) that refuses too."""
    if depth == 0 or id(obj) in seen:
        return None
    seen.add(id(obj))
    for name, value in _parts_of(obj):
        if isinstance(value, (np.ndarray, str, bytes, int, float)) or _picklable(value):
            continue
        return _refusing(value, depth - 1, seen) or (name, value)
    return None


def _picklable(obj: Any) -> bool:
    try:
        with shipping():  # (procpipe's own shared memory in it travels beside the pickle: not a refusal)
            dump_value(obj)
    except Exception:  # noqa: BLE001 - whatever pickling raises, the answer is no
        return False
    return True


def ship_spec(data: bytes, fds: list[SharedFd], segments: Segments) -> ShippedSpec:
    """The pickled spec ``data`` in a sealed segment of shared memory (no worker can change it),
    held until the loader closes, with the descriptors pickled inside it: what a worker receives."""
    fd = segments.new(
        "spec", len(data), "the serialized dataset and functions", "a smaller dataset", data, anonymous=True
    )
    segments.hold(fd)
    seal_writes(fd)
    return ShippedSpec(SharedFd(fd), len(data), fds)
