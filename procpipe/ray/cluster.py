"""The Ray cluster's nodes for ``procpipe.ray``: joining the cluster, this node's object
store, and where an agent may start: nodes that are alive now, not merely listed as alive.

Ray keeps a node it lost listed as alive for seconds (until its health checks time out),
and places actors there meanwhile: an agent started then dies with "The actor died
unexpectedly" some fifteen seconds later. So ``procpipe.ray`` asks the nodes themselves:
a node is live when Ray lists it alive, has the resources an agent needs, and its raylet
accepts a connection now (a lost node's raylet refuses it, or does not answer within a
second). Agents then start on live nodes (``NodeAffinitySchedulingStrategy``), and one
that still dies before it answers is started again on another live node, while its
start deadline allows (``RayPool._wait_ready``).
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Any

import ray

PROBE_TIMEOUT_S = 1.0  # a raylet that does not accept a connection within this is taken as lost


def raylet_answers(node: dict[str, Any], timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the node's raylet accepts a TCP connection now (``ray.nodes()``'s entry)."""
    address, port = node.get("NodeManagerAddress"), node.get("NodeManagerPort")
    if not address or not port:
        return True  # (cannot tell: trust Ray's listing)
    try:
        socket.create_connection((address, int(port)), timeout=timeout).close()
    except OSError:
        return False
    return True


def fits(resources: dict[str, float], needs: dict[str, float]) -> bool:
    """A node with ``resources`` (its totals) can hold an agent that ``needs`` these."""
    return all(resources.get(k, 0) >= v for k, v in needs.items())


def spare_node(
    table: Iterable[tuple[str, dict[str, float]]], needs: dict[str, float], used: AbstractSet[str]
) -> str | None:
    """The first node of ``table`` (``(node id, resources)``) that fits and is not in ``used``."""
    return next((node_id for node_id, resources in table if node_id not in used and fits(resources, needs)), None)


def live_nodes(needs: dict[str, float], exclude: AbstractSet[str] = frozenset()) -> list[str]:
    """Ids of the nodes an agent needing ``needs`` may start on now (module doc), but ``exclude``."""
    return [
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive")
        and n["NodeID"] not in exclude
        and fits(dict(n.get("Resources", {})), needs)
        and raylet_answers(n)
    ]


def connect(address: str | None) -> None:
    """Join the cluster at ``address`` unless this process already has a Ray session."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except ConnectionError as exc:
        raise ConnectionError(
            f"procpipe.ray.Backend(address={address!r}) found no Ray cluster: {exc}. Start one "
            "(`ray start --head` on the head node, `ray start --address=<head>:6379` on the others), "
            "call ray.init(...) yourself before creating the Loader, or pass address=None to start "
            "a Ray instance on this machine."
        ) from exc


def local_object_store() -> int:
    """Bytes of this node's Ray object store (0: unknown)."""
    try:
        me = ray.get_runtime_context().get_node_id()
        return int(next(n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["NodeID"] == me))
    except Exception:  # noqa: BLE001 - cannot tell: admit() then checks nothing
        return 0
