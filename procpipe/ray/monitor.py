"""The pool's monitor thread: heartbeats of the agents, and the cluster's node table.

About once a second it pings every agent (``Agent.ping``); one silent for ``node_timeout``
seconds is declared lost (its node may have vanished without a word, which Ray reports only
much later). It also waits for replacements to start (``Agent.node``: their answer makes
them ready), kills the agents declared lost (a silent one may still run somewhere), and
reads the cluster's nodes every few seconds, where replacements may go: all of this off
the coordinator's thread, which never waits on Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import ray

from .options import BackendOptions
from .remote import AgentSlot

logger = logging.getLogger("procpipe")

CALL_TIMEOUT_S = 10.0  # a control call to an agent (close, ping) that takes longer is given up on
START_FAILED = "loading the dataset and functions, or starting its worker processes, failed on its node"
_PING_EVERY_S = 1.0  # heartbeat period
_NODES_EVERY_S = 2.0  # how often the monitor reads the cluster's nodes


class Watched(Protocol):
    """What the monitor needs of its pool (``RayPool``)."""

    backend: BackendOptions
    agents: list[AgentSlot | None]
    closed: bool

    def lose(self, agent: AgentSlot, why: str) -> None: ...

    def started(self, agent: AgentSlot, node_id: str, pid: int, prefix: str | None) -> None: ...

    def kill_doomed(self) -> None: ...


class Monitor:
    """The monitor of ``pool``'s agents (``start`` runs its thread; ``join`` waits for its end)."""

    def __init__(self, pool: Watched) -> None:
        self.pool = pool
        self.node_table: list[tuple[str, dict[str, float]]] = []  # (node id, total resources) of alive nodes
        self.node_table_at = 0.0
        self.thread = threading.Thread(target=self._watch, name="procpipe-ray-monitor", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float) -> None:
        """Wait for the thread to end (the pool is closed), unless called from it."""
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def _watch(self) -> None:
        """Ping every agent about once a second; one silent for ``node_timeout`` seconds is lost.
        Also kills the agents declared lost (a silent one may still be running somewhere)."""
        pending: dict[Any, AgentSlot] = {}
        while not self.pool.closed:
            try:
                self._watch_once(pending)
            except Exception:  # the monitor must outlive any one failure (it logs, goes on)
                logger.exception("procpipe.ray: the agent monitor failed one round; it goes on")
                time.sleep(_PING_EVERY_S)

    def _watch_once(self, pending: dict[Any, AgentSlot]) -> None:
        """One round of ``_watch``."""
        timeout = self.pool.backend.node_timeout
        self.pool.kill_doomed()
        now = time.monotonic()
        if now - self.node_table_at >= _NODES_EVERY_S:  # where replacements may go (read here, not
            self.node_table_at = now  # on the coordinator thread)
            self.node_table = [(n["NodeID"], dict(n.get("Resources", {}))) for n in ray.nodes() if n.get("Alive")]
        for agent in list(self.pool.agents):
            if agent is None or not agent.alive:
                continue
            if not agent.ready:  # a replacement, starting: ask where it runs (its answer: started)
                if agent.ping_sent is None:
                    self._ask(agent, "node", pending, now)
                elif now - agent.started > self.pool.backend.start_timeout:
                    self.pool.lose(
                        agent,
                        f"it did not start within start_timeout={self.pool.backend.start_timeout} s: "
                        "no node had room for it",
                    )
            elif agent.ping_sent is None and now - agent.pong_at >= _PING_EVERY_S:
                self._ask(agent, "ping", pending, now)
            elif agent.ping_sent is not None and now - agent.ping_sent > timeout:
                self.pool.lose(agent, f"no heartbeat for {timeout} s (node_timeout)")
        for ref in [r for r, a in pending.items() if not a.alive]:
            del pending[ref]
        if not pending:
            time.sleep(_PING_EVERY_S / 2)
            return
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=_PING_EVERY_S / 2)
        for ref in ready:
            agent = pending.pop(ref)
            try:
                answer = ray.get(ref, timeout=CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - actor died, node lost, or it could not start
                why = f"{type(exc).__name__}: {exc}"
                self.pool.lose(agent, why if agent.ready else f"{START_FAILED}: {why}")
                continue
            if not agent.ready:
                self.pool.started(agent, *answer)
            agent.ping_sent = None
            agent.pong_at = time.monotonic()

    def _ask(self, agent: AgentSlot, method: str, pending: dict[Any, AgentSlot], now: float) -> None:
        """Call ``agent.<method>()`` (``node`` or ``ping``); its answer is awaited in ``pending``."""
        try:
            pending[getattr(agent.handle, method).remote()] = agent
        except Exception as exc:  # noqa: BLE001 - the actor handle is dead already
            self.pool.lose(agent, f"{type(exc).__name__}: {exc}")
            return
        agent.ping_sent = now
