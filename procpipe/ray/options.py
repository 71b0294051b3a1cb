"""The options of ``procpipe.ray.Backend``, validated once: what the pool (ray_pool.py) reads.

Kept apart from ``Backend`` (backend.py), which adds the factory of the pool: the pool
needs the options, the backend needs the pool, and neither module imports the other's importer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendOptions:
    """Where a Loader's workers run and how lost nodes are handled (fields: ``Backend``'s docstring)."""

    nodes: int = 1
    cpus_per_node: float | None = None
    resources: dict[str, float] | None = None
    address: str | None = "auto"
    max_node_restarts: int = 3
    node_timeout: float = 10.0
    start_timeout: float = 120.0
    start_method: str = "forkserver"

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"Backend(nodes=...) must be an int >= 1, got {self.nodes!r}")
        if self.cpus_per_node is not None and not (
            isinstance(self.cpus_per_node, (int, float)) and self.cpus_per_node >= 0
        ):
            raise ValueError(f"Backend(cpus_per_node=...) must be a number >= 0 or None, got {self.cpus_per_node!r}")
        if self.resources is not None and not (
            isinstance(self.resources, dict)
            and all(isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in self.resources.items())
        ):
            raise ValueError(f"Backend(resources=...) must map resource names to amounts >= 0, got {self.resources!r}")
        if (
            isinstance(self.max_node_restarts, bool)
            or not isinstance(self.max_node_restarts, int)
            or self.max_node_restarts < 0
        ):
            raise ValueError(f"Backend(max_node_restarts=...) must be an int >= 0, got {self.max_node_restarts!r}")
        for name in ("node_timeout", "start_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Backend({name}=...) must be a number of seconds > 0, got {value!r}")
        if self.start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"Backend(start_method=...) must be 'forkserver' or 'spawn', got {self.start_method!r} "
                "(an agent is a threaded Ray actor: fork is unsafe there)"
            )

    def agent_needs(self, workers: int) -> dict[str, float]:
        """What one agent of ``workers`` worker processes takes on its node."""
        return {"CPU": workers if self.cpus_per_node is None else self.cpus_per_node, **(self.resources or {})}
