"""``Backend``: the ``Loader(backend=...)`` value that runs the workers on a Ray cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import EngineConfig
from . import cluster
from .options import BackendOptions
from .ray_pool import RayPool

if TYPE_CHECKING:
    from .._worker.worker_spec import WorkerSpec


@dataclass(frozen=True)
class Backend(BackendOptions):
    """Where a Loader's workers run: ``nodes`` Ray agents, each with ``workers`` processes.

    Args:
        nodes: agents to start (one per node when each node has ``cpus_per_node`` CPUs: Ray
            places them with its SPREAD strategy, so they land on different nodes where they can).
        cpus_per_node: CPUs each agent reserves from Ray (default: the Loader's ``workers``).
        resources: extra Ray resources each agent needs (e.g. ``{"preprocess": 1}`` to keep
            agents on the nodes that advertise it, or one label per data-parallel rank).
        address: the cluster: ``"auto"`` (the running cluster, as ``ray start`` leaves it),
            an address (``"ray://..."`` or ``"host:port"``), or None to start a local one. If
            this process already called ``ray.init``, that session is used as it is.
        max_node_restarts: lost agents replaced per loader before it fails with ``NodeLostError``.
        node_timeout: seconds an agent may miss its heartbeats before it is declared lost
            (a node that disappears without a word is detected within this bound).
        start_timeout: seconds an agent may take to start (Ray must find a node with room).
        start_method: how each agent starts its worker processes: ``"forkserver"`` (default)
            or ``"spawn"`` (an agent is a threaded Ray actor, where ``fork`` is unsafe).
    """

    def lanes(self, workers: int) -> int:
        """The workers the coordinator sees: ``workers`` per agent."""
        return self.nodes * workers

    def pool(self, spec: WorkerSpec, config: EngineConfig, segments: Any, cache: Any) -> RayPool:
        """The engine's pool (start.py calls this): connects to the cluster and starts the agents,
        each with its share of the engine's workers and their environment."""
        from .._worker.spec_shipping import dump_spec

        data, fds = dump_spec(spec)
        if fds:  # (a descriptor of this process's shared memory means nothing on another node)
            raise TypeError(
                "procpipe.ray: the dataset holds shared memory of this process (a cache or replica snapshots "
                "made here), which cannot travel to other nodes; pass it without, and let each node make its own"
            )
        cluster.connect(self.address)
        return RayPool(self, data, config.workers // self.nodes, dict(config.worker_env), cache, segments.directory)
