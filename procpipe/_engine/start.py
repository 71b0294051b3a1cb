"""Starting a Loader's engine, in the calling process: everything before the first worker runs.

``start_engine`` is given the loader's shared memory (``Segments``: anonymous, or files in
``shm_dir``) and its ``WorkerSpec``, its cache opened (_consumer/assembly.py, cache.py
``open_cache``: which computes the first sample); it ships the spec to the workers
(_worker/spec_shipping.py ``ship``: pickled once, with cloudpickle or dill, into a sealed segment of
shared memory each worker receives as it starts; with ``"fork"`` it is inherited instead),
gets the multiprocess context (``context``: with ``"forkserver"``, the server is started
with the workers' environment and told to preload the modules the pickle references, in
the parent's import order: spec_shipping.py ``preload_list``, preload.py) and starts the
``Coordinator``, which starts the workers. If any step fails, everything made so far is released.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .._core.shm import Segments, proc_address
from .._worker.cache_file import prefix_of
from .._worker.spec_shipping import ship
from .._worker.start_method import context as start_context
from .._worker.worker_spec import WorkerSpec
from ..config import EngineConfig
from .coordinator import Coordinator
from .pool import LocalPool


def start_engine(
    config: EngineConfig, spec: WorkerSpec, cache: Any, segments: Segments, backend: Any = None
) -> Coordinator:
    """The coordinator of a loader with workers, its workers started; on failure ``segments`` are removed.

    ``spec``: its cache opened (``assemble``, cache.py ``open_cache``), or none for a remote backend;
    ``cache``: the ``cache=`` argument; ``segments``: the loader's shared memory.
    ``backend``: None for worker processes on this machine (``LocalPool``), or a remote
    backend (``procpipe.ray.Backend``) whose ``pool(spec, config, segments, cache)`` makes the pool
    (each of its agents opens its own cache).
    """
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
    """Worker processes on this machine: ``spec`` (its cache opened: cache.py ``open_cache``) shipped
    to them (``own_session``: see ``process.worker_main``), and the start method's context (a
    forkserver preloads the modules the shipped objects reference). ``cache``: the ``cache=`` argument."""
    capacity = config.workers if config.autotune is None else max(config.autotune.hard_max, config.workers)
    # the named files a worker removes if this process is killed (anonymous memory needs nobody)
    leftovers = tuple(p for p in (segments.prefix, prefix_of(cache, segments)) if p is not None)
    if config.start_method == "fork":
        return LocalPool(start_context("fork"), spec, segments, leftovers, config.worker_env, capacity, own_session)
    shipped, preload = ship(spec, config.start_method, segments)
    ctx = context(config.start_method, config.worker_env, segments, preload)
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
