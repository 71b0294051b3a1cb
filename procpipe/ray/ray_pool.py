"""``RayPool``: _engine/pool.py's ``WorkerPool`` over Ray agents (agent.py), one per node.

``nodes`` agents of ``workers`` lanes each: the coordinator's worker ``i`` is lane
``i % workers`` of agent ``i // workers``. The pool starts the agents on live nodes
(cluster.py), sends each lane's tasks as actor calls (replies reach the lane's
``RemoteWorker``, remote.py, from Ray's callback thread), replaces a lost agent when one of
its lanes is started again (at most ``max_node_restarts`` times), and ends them all on
``stop``. Its monitor thread (monitor.py) pings the agents and declares the silent ones lost.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import ray

from .._core.messages import BatchFailed, ErrorInfo, Task, WorkerReady
from .._core.stats import WorkerCounters
from .._engine.pool import WorkerLink, WorkerPool
from ..errors import NodeLostError, ObjectStoreError
from . import cluster
from .agent import Agent
from .monitor import CALL_TIMEOUT_S, START_FAILED, Monitor
from .options import BackendOptions
from .remote import AgentSlot, RemoteWorker, kill_agent

_CLOSE_WAIT_S = 3.0  # close(): how long the agents get to stop their workers before they are killed


class RayPool(WorkerPool):
    """``nodes`` agents of ``workers`` lanes each; the coordinator's WorkerPool for a Ray cluster."""

    uses_ring = False  # batches come through Ray's object store, not the coordinator's ring
    # A round trip through Ray takes milliseconds: a lane holds more tasks, so that its worker
    # never waits for the next one (they wait in the agent, in order; none in the object store).
    tasks_per_worker = 4

    def __init__(
        self,
        backend: BackendOptions,
        spec_bytes: bytes,
        workers: int,
        env: dict[str, str],
        cache: Any,
        shm_dir: str | None,
    ) -> None:
        self.backend = backend
        self.workers = workers
        self.env = env
        self.cache = cache
        self.shm_dir = shm_dir
        self.spec_ref = ray.put(spec_bytes)
        self.lock = threading.RLock()
        self.agents: list[AgentSlot | None] = [None] * backend.nodes
        self.restarts = 0
        self.generations = 0
        self.links: dict[int, RemoteWorker] = {}  # lane index -> its live link
        self.doomed: deque[Any] = deque()  # handles of lost agents, for the monitor to kill
        self.born = time.monotonic()
        # (t, "lost" / "replacing" / "ready", agent, detail)
        self.events: deque[tuple[float, str, int, str]] = deque(maxlen=1000)
        self.closed = False
        self.monitor = Monitor(self)  # (its thread starts once the agents are ready)
        self._actor = ray.remote(Agent).options  # (a class per pool: ray.remote wraps it)
        self.store_bytes = cluster.local_object_store()  # read here: admit() runs on the coordinator thread
        try:  # on live nodes, distinct ones where there are enough (cluster.py)
            live = iter(cluster.live_nodes(self._needs()))
            for number in range(backend.nodes):
                self.agents[number] = self._start_agent(number, target=next(live, None))
            self._wait_ready([a for a in self.agents if a is not None])
        except BaseException:
            self._kill_all()
            raise
        self.monitor.start()

    # ---- agents
    def _needs(self) -> dict[str, float]:
        """What one agent takes on its node."""
        return self.backend.agent_needs(self.workers)

    def _start_agent(self, number: int, lost_on: str = "", target: str | None = None) -> AgentSlot:
        """A new agent (not waited for), on node ``target`` if given. ``lost_on``: the node its
        predecessor was lost on, which Ray may still count as alive for seconds: the
        replacement goes elsewhere if it can."""
        backend = self.backend
        cpus = self._needs()["CPU"]
        options: dict[str, Any] = {
            "num_cpus": cpus,
            "resources": dict(backend.resources or {}),
            "max_restarts": 0,
            "max_task_retries": 0,
            "max_concurrency": self.workers * 8 + 8,
            "scheduling_strategy": "SPREAD",
        }  # agents on different nodes where they fit
        if lost_on:
            used = {a.node_id for a in self.agents if a is not None and a.alive} | {lost_on}
            target = cluster.spare_node(self.monitor.node_table, self._needs(), used)
        if target is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(target, soft=True)
        handle = self._actor(**options).remote(
            self.spec_ref, self.workers, self.env, self.cache, self.shm_dir, backend.start_method, backend.start_timeout
        )
        return AgentSlot(number, handle, target=target)

    def _wait_ready(self, agents: list[AgentSlot]) -> None:
        """Wait (at most ``start_timeout``) for the agents to answer: Ray found them a node, and
        their worker processes started. One that died first (its node was lost) starts again on
        another live node while the deadline allows; one whose own start failed ends it all."""
        deadline = time.monotonic() + self.backend.start_timeout
        pending = {a.handle.node.remote(): a for a in agents}
        tried: set[str] = set()  # nodes given to agents that died before answering
        while pending and (left := deadline - time.monotonic()) > 0:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            for ref in ready:
                agent = pending.pop(ref)
                try:
                    answer = ray.get(ref, timeout=CALL_TIMEOUT_S)
                except ray.exceptions.RayError as exc:
                    again = self._start_again(agent, exc, tried)
                    pending[again.handle.node.remote()] = again
                    continue
                self.started(agent, *answer)
        if pending:
            backend = self.backend
            cpus = self.workers if backend.cpus_per_node is None else backend.cpus_per_node
            raise NodeLostError(
                f"procpipe: {len(pending)} of {len(agents)} Ray agent(s) did not start within start_timeout="
                f"{backend.start_timeout} s. Each needs num_cpus={cpus} and resources={backend.resources or {}} on "
                f"one node; the cluster has {ray.available_resources()} available. Add nodes, lower "
                "Backend(nodes=...) or cpus_per_node, or raise start_timeout."
            )

    def _start_again(self, agent: AgentSlot, exc: BaseException, tried: set[str]) -> AgentSlot:
        """``agent`` died before it answered: a new one on a live node not tried yet (its own
        start failing, or no such node, raises: that would fail again)."""
        if (
            not isinstance(exc, ray.exceptions.RayActorError)
            or exc.actor_init_failed
            or len(tried) > self.backend.nodes + len(self.agents)
        ):
            raise RuntimeError(f"procpipe: a Ray agent could not start ({START_FAILED}): {exc}") from exc
        kill_agent(agent.handle)
        tried.add(agent.target or "")
        used = {a.node_id for a in self.agents if a is not None and a.ready} | tried
        target = next(iter(cluster.live_nodes(self._needs(), exclude=used)), None)
        self._event("replacing", agent.number, f"it died before it answered: {exc}"[:200])
        again = self.agents[agent.number] = self._start_agent(agent.number, target=target)
        return again

    def _agent(self, number: int) -> AgentSlot:
        """Agent ``number``, replaced first if it was lost (counted against max_node_restarts).

        Never waits for the replacement to start (the coordinator thread calls this): tasks
        sent to it wait in Ray's queue meanwhile, and the monitor thread declares it lost if
        it does not start within ``start_timeout``."""
        with self.lock:
            agent = self.agents[number]
            if agent is not None and agent.alive:
                return agent
            if self.restarts >= self.backend.max_node_restarts:
                raise NodeLostError(
                    f"procpipe: a Ray agent was lost ({agent.lost_why if agent else 'unknown'}) and "
                    f"max_node_restarts={self.backend.max_node_restarts} agents have already been replaced by "
                    "this loader. Check the nodes' health (`ray status`, the raylet logs), or raise "
                    "Backend(max_node_restarts=...)."
                )
            self.restarts += 1
            self._event("replacing", number)
            replacement = self._start_agent(number, agent.node_id if agent else "")
            self.agents[number] = replacement
            return replacement

    def started(self, agent: AgentSlot, node_id: str, pid: int, prefix: str | None) -> None:
        """``agent`` answered: its lanes' tasks now run (their time counts from here)."""
        with self.lock:
            agent.node_id, agent.pid, agent.files_prefix, agent.ready = node_id, pid, prefix, True
            self._event("ready", agent.number, node_id)
            lanes = [link for link in self.links.values() if link.agent is agent]
        for link in lanes:
            link.deliver([WorkerReady(pid)])

    def lose(self, agent: AgentSlot, why: str) -> None:
        """Agent lost: every lane of it ends (the coordinator re-queues their tasks and asks for new ones)."""
        with self.lock:
            if not agent.alive:
                return
            agent.alive = False
            agent.lost_why = why
            self._event("lost", agent.number, why)
            lanes = [link for link in self.links.values() if link.agent is agent]
        for link in lanes:
            link.end(agent_lost=True)
        self.doomed.append(agent.handle)  # killed by the monitor thread (not from a Ray callback)

    # ---- WorkerPool
    def start(self, index: int, counters: WorkerCounters) -> RemoteWorker:
        number, lane = divmod(index, self.workers)
        with self.lock:  # (one section: a loss of the agent either sees this link or comes before it)
            agent = self._agent(number)
            self.generations += 1
            link = RemoteWorker(index, counters, self, agent, lane, self.generations)
            link.ready = agent.ready  # else its WorkerReady comes when the agent answers (started)
            self.links[index] = link
        counters.rss_bytes = 0
        return link

    def submit(self, link: RemoteWorker, seq: int, task: Task) -> None:
        """Send ``task`` to ``link``'s lane; its reply reaches ``link.deliver`` from Ray's callback thread."""
        agent = link.agent
        try:
            ref = agent.handle.run.remote(link.lane, link.generation, seq, task)
        except Exception as exc:  # noqa: BLE001 - the actor handle is dead already
            self._lost(link, exc)
            return

        def done(future: Any) -> None:
            try:
                skipped, reply = future.result()
            except ray.exceptions.RayTaskError as exc:  # the agent could not run or return this batch
                link.deliver([_batch_error(task, exc)])
                return
            except BaseException as exc:  # noqa: BLE001 - actor died, node lost, object lost...
                self._lost(link, exc)
                return
            link.deliver([*skipped, reply])

        ref.future().add_done_callback(done)

    def _lost(self, link: RemoteWorker, exc: BaseException) -> None:
        """A call to ``link``'s agent failed with a Ray error: the agent is lost, and so is the lane
        (even if the agent was declared lost before this link was made)."""
        self.lose(link.agent, f"{type(exc).__name__}: {exc}")
        link.end(agent_lost=True)

    def kill_lane(self, link: RemoteWorker) -> None:
        """``task_timeout``: the agent ends the lane's process; its answer (a ``WorkerLost``,
        unless a running task reported the death already) ends the link."""
        try:
            ref = link.agent.handle.kill_lane.remote(link.lane, link.generation)
        except Exception as exc:  # noqa: BLE001
            self._lost(link, exc)
            return

        def done(future: Any) -> None:
            try:
                lost = future.result()
            except BaseException as exc:  # noqa: BLE001 - actor died, node lost...
                self._lost(link, exc)
                return
            if lost is not None:
                link.deliver([lost])

        ref.future().add_done_callback(done)

    def stop(self, links: list[WorkerLink]) -> None:
        self.closed = True
        agents = [a for a in self.agents if a is not None and a.alive]
        refs = []
        for agent in agents:
            try:
                refs.append(agent.handle.close.remote())
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
        if refs:  # (bounded: the coordinator's close() waits a few seconds for all of this)
            ray.wait(refs, num_returns=len(refs), timeout=_CLOSE_WAIT_S)
        self._kill_all()
        for link in links:
            if isinstance(link, RemoteWorker):
                link.reap()

    def _kill_all(self) -> None:
        for agent in self.agents:
            if agent is not None:
                agent.alive = False
                kill_agent(agent.handle)
        self.kill_doomed()

    def kill_doomed(self) -> None:
        """Kill the agents declared lost (the monitor's thread, and ``stop``)."""
        while self.doomed:
            kill_agent(self.doomed.popleft())

    def admit(self, batch_bytes: int, in_flight: int) -> None:
        """Fail early if the batches in flight would not fit the object store of this node."""
        store = self.store_bytes
        needed = batch_bytes * (in_flight + 1)
        if store and needed > store * 0.8:
            raise ObjectStoreError(
                f"procpipe: a batch is {batch_bytes / 2**20:.1f} MiB and the loader keeps up to {in_flight + 1} in "
                f"flight ({needed / 2**20:.0f} MiB), but this node's Ray object store holds "
                f"{store / 2**20:.0f} MiB (80 % usable before Ray spills to disk). Use a smaller batch_size or "
                "prefetch, fewer workers or nodes, or start Ray with a larger --object-store-memory."
            )

    def info(self) -> dict[str, Any]:
        """``stats()["backend"]``: the agents now (node, pid, started), agents replaced so far,
        and the events of agent losses and starts, ``(seconds since the pool started, what,
        agent number, detail)``, in order; ``started``: when the pool started (``time.monotonic()``)."""
        with self.lock:
            agents = [
                None
                if a is None
                else {
                    "number": a.number,
                    "node": a.node_id,
                    "pid": a.pid,
                    "ready": a.ready,
                    "alive": a.alive,
                    "files": a.files_prefix,
                }
                for a in self.agents
            ]
            return {
                "kind": "ray",
                "started": self.born,
                "nodes": self.backend.nodes,
                "workers_per_node": self.workers,
                "agents": agents,
                "restarts": self.restarts,
                "events": list(self.events),
            }

    def _event(self, what: str, number: int, detail: str = "") -> None:
        self.events.append((round(time.monotonic() - self.born, 4), what, number, detail))

    def close(self) -> None:
        self.closed = True
        self.monitor.join(2.0)


def _batch_error(task: Task, exc: BaseException) -> BatchFailed:
    """The error of a batch the agent could not run or send back (``RayTaskError``): raised in
    the batch's place, as a reply that does not unpickle is locally."""
    import traceback

    text = (
        f"the Ray agent could not run or return the batch of task {task.id} (a sample Ray cannot "
        f"serialize, or a failure in procpipe's agent): {exc}"
    )
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return BatchFailed(task.id, ErrorInfo(None, None, "builtins.RuntimeError", text, tb), 0.0)
