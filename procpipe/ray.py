"""procpipe on a Ray cluster: preprocessing on remote CPU nodes, with procpipe's guarantees.

``Loader(..., backend=procpipe.ray.Backend(nodes=2))`` runs the user's Python on Ray nodes
instead of this machine. Everything else stays where it is: the sampler, the coordinator,
ordered / sloppy reassembly, resume bookkeeping and the device stage run in the training
process, exactly as with local workers; only the worker pool is remote (``RayPool``, the
second implementation of pool.py's ``WorkerPool``)::

    training process                                   Ray node (one Agent actor each)
    ─────────────────────────────────────────           ─────────────────────────────────
    Coordinator ── Task ──► RemoteWorker.put ─ actor call ─► Agent.run(lane, task)
        ▲                                                     │ LocalPool: `workers` procpipe
        │                                                     │ worker processes, a ring of
        │                                                     ▼ its own, fn/augment/collate/...
    RemoteWorker.read ◄── inbox ◄── future callback ◄── BatchDone, its arrays inline
                          (the batch arrives through Ray's object store, zero-copy here)

- **Lanes.** ``workers=`` keeps its meaning per node: each agent runs that many worker
  processes, and the coordinator sees ``nodes * workers`` workers ("lanes"); lane ``i``
  is agent ``i // workers``'s worker ``i % workers``. Each lane runs its tasks in the order
  they were sent, at most the coordinator's few per worker in flight (backpressure:
  nothing piles up in the object store).
- **Faults.** Ray's own retries are off (``max_restarts=0``, ``max_task_retries=0``). A
  worker process that dies inside an agent is restarted there, and its lane's tasks are
  re-run by the coordinator (counted against ``max_worker_restarts``, as locally). An
  agent that is lost (its node died, it was killed, an object it held was lost, or it
  missed its heartbeats for ``node_timeout`` seconds) takes its lanes with it: their
  tasks are re-queued on the other lanes, and a new agent is started on any node with
  room (at most ``max_node_restarts`` times per loader). Samples are deterministic from
  ``(seed, epoch, index)``, so a re-run gives the same bytes, and reassembly refuses a
  position twice: every index exactly once, batches identical to a fault-free run.
- **Cleanup.** ``close()`` ends the agents (their worker processes and ``/dev/shm`` files
  with them); an agent killed with its node or the cluster leaves nothing either: its
  workers see it gone, remove the files and exit (worker/process.py).

Every wait on a remote result has a timeout: replies come back through callbacks, agent
starts are bounded by ``start_timeout``, heartbeats by ``node_timeout``, ``close()`` by a
few seconds. Import this module only where Ray is installed (``pip install procpipe[ray]``);
``import procpipe`` never imports it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray

from .core.messages import STOP, BatchDone, BatchFailed, ErrorInfo, Reply, Task, WorkerFatal, WorkerLost, WorkerReady
from .engine.pool import WorkerLink, WorkerPool
from .core.stats import WorkerCounters
from . import ray_nodes

__all__ = ["Backend", "NodeLostError", "ObjectStoreError", "RayPool"]

logger = logging.getLogger("procpipe")

_CALL_TIMEOUT_S = 10.0  # a control call to an agent (close, ping) that takes longer is given up on
_PING_EVERY_S = 1.0  # heartbeat period
_NODES_EVERY_S = 2.0  # how often the monitor reads the cluster's nodes
_CLOSE_WAIT_S = 3.0  # close(): how long the agents get to stop their workers before they are killed
_START_FAILED = "loading the dataset and functions, or starting its worker processes, failed on its node"


class NodeLostError(RuntimeError):
    """Agents were lost more often than ``Backend(max_node_restarts=...)`` allows, or none could start."""


class ObjectStoreError(RuntimeError):
    """The batches the loader keeps in flight would not fit in the Ray object store."""


@dataclass(frozen=True)
class Backend:
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
        if self.cpus_per_node is not None and not (isinstance(self.cpus_per_node, (int, float))
                                                   and self.cpus_per_node >= 0):
            raise ValueError(f"Backend(cpus_per_node=...) must be a number >= 0 or None, got {self.cpus_per_node!r}")
        if self.resources is not None and not (isinstance(self.resources, dict) and all(
                isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in self.resources.items())):
            raise ValueError(f"Backend(resources=...) must map resource names to amounts >= 0, got {self.resources!r}")
        if isinstance(self.max_node_restarts, bool) or not isinstance(self.max_node_restarts, int) \
                or self.max_node_restarts < 0:
            raise ValueError(f"Backend(max_node_restarts=...) must be an int >= 0, got {self.max_node_restarts!r}")
        for name in ("node_timeout", "start_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Backend({name}=...) must be a number of seconds > 0, got {value!r}")
        if self.start_method not in ("forkserver", "spawn"):
            raise ValueError(f"Backend(start_method=...) must be 'forkserver' or 'spawn', got {self.start_method!r} "
                             "(an agent is a threaded Ray actor: fork is unsafe there)")

    def lanes(self, workers: int) -> int:
        """The workers the coordinator sees: ``workers`` per agent."""
        return self.nodes * workers

    def pool(self, spec: Any, config: Any, files: Any, cache: Any) -> RayPool:
        """The engine's pool (start.py calls this): connects to the cluster and starts the agents."""
        from .worker.process import dump_spec

        ray_nodes.connect(self.address)
        return RayPool(self, dump_spec(spec), config.workers // self.nodes, dict(config.worker_env), cache,
                       files.directory)


# --------------------------------------------------------------------------- the agent (a Ray actor)
@dataclass(eq=False)
class _Lane:
    """One worker process of an agent, and the order its tasks run in."""

    link: Any  # a pool.LocalWorker
    turn: threading.Condition = field(default_factory=threading.Condition)
    generation: int = -1  # the trainer-side link now using this lane
    lost_up_to: int = -1  # calls from generations up to this one are answered WorkerLost
    next_seq: int = 0  # the seq of the call whose turn it is (per generation)


class Agent:
    """Runs on one Ray node: procpipe's local worker pool and a ring there, driven by actor calls.

    ``run`` is called concurrently (a threaded actor); each lane serves its calls one at a
    time, in the order the trainer sent them (``seq``). The worker writes the batch into a
    slot of this agent's ring; the reply carries the arrays as views of the slot, which Ray
    copies into its object store when it sends the result, after which the slot is free
    again (a lease, as in the training process).
    """

    def __init__(self, spec_bytes: bytes, workers: int, env: dict[str, str], cache: Any, shm_dir: str,
                 start_method: str, start_timeout: float) -> None:
        import dill

        from .engine.coordinator import EngineConfig
        from .core.shm import SharedFiles
        from .engine.start import local_pool

        self.files = SharedFiles(shm_dir)
        spec = dill.loads(spec_bytes)
        config = EngineConfig(workers, True, 0, None, 0, env, start_method)
        self.pool = local_pool(config, spec, cache, self.files, own_session=True)
        self.start_timeout = start_timeout
        self.lanes = [_Lane(self.pool.start(i, WorkerCounters())) for i in range(workers)]
        for lane in self.lanes:  # an agent that answers has every worker ready: tasks' time runs from there
            self._wait_ready(lane.link)
        self.rings: list[Any] = []  # the current ring last; older ones until their slots are back
        self.ring_lock = threading.Lock()
        self.slots = 2 * workers + 2  # each lane's running batch, and the one Ray is still sending
        self.closed = False

    @staticmethod
    def _next_reply(link: Any, timeout: float) -> Any:
        """The worker's next message, or None after ``timeout`` seconds; ``EOFError`` once it died."""
        from multiprocess.connection import wait

        from .core import wire

        ready = wait([link.conn, link.process.sentinel], timeout)
        if link.conn in ready:
            try:
                return wire.decode(link.conn.recv_bytes())
            except OSError as exc:
                raise EOFError from exc
        if link.process.sentinel in ready:
            raise EOFError
        return None

    def _wait_ready(self, link: Any) -> None:
        """Wait until a new worker process has loaded the dataset and functions (``WorkerReady``)."""
        from .core.messages import WorkerReady

        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            try:
                reply = self._next_reply(link, 1.0)
            except EOFError:
                break
            if isinstance(reply, WorkerReady):
                return
            if isinstance(reply, WorkerFatal):
                raise RuntimeError(f"a procpipe worker on this node could not load the dataset, fn or "
                                   f"collate_fn:\n{reply.traceback}")
        raise RuntimeError(f"a procpipe worker on this node did not start (exit code {link.exitcode}) within "
                           f"start_timeout={self.start_timeout} s; its traceback, if any, is in the node's Ray logs")

    def _restart(self, lane: _Lane, lane_index: int, generation: int, task_id: int) -> WorkerLost:
        """The lane's process died (or was killed): a new one, ready, before the death is reported."""
        link = lane.link
        index = link.stuck_on(_AttemptId(task_id))
        link.process.join(1.0)
        code = link.exitcode
        link.reap()
        lane.lost_up_to = generation
        lane.link = self.pool.start(lane_index, WorkerCounters())
        try:
            self._wait_ready(lane.link)
        except RuntimeError:
            pass  # its first task will find it dead and report that
        return WorkerLost(task_id, code, index)

    def node(self) -> tuple[str, int, str]:
        """(Ray node id, pid, files prefix): where this agent runs and what it created there;
        answering it means the agent and its workers are up."""
        return ray.get_runtime_context().get_node_id(), os.getpid(), self.files.prefix

    def ping(self) -> bool:
        return not self.closed

    def run(self, lane_index: int, generation: int, seq: int, task: Task) -> tuple[list, Reply]:
        """Run ``task`` on lane ``lane_index``: ``(SamplesSkipped replies, the final reply)``."""
        lane = self.lanes[lane_index]
        with lane.turn:
            if generation > lane.generation:  # a new link took the lane over: its calls count from 0
                lane.generation, lane.next_seq = generation, 0
            while not (generation <= lane.lost_up_to or generation < lane.generation or seq == lane.next_seq):
                lane.turn.wait(1.0)
            if generation <= lane.lost_up_to or generation < lane.generation:
                return [], WorkerLost(task.id, None, None)  # sent to a worker that has since died
            try:
                return self._run(lane, lane_index, generation, task)
            finally:
                lane.next_seq += 1
                lane.turn.notify_all()

    def _run(self, lane: _Lane, lane_index: int, generation: int, task: Task) -> tuple[list, Reply]:
        from .core import wire
        from .core.messages import SamplesSkipped, WorkerReady

        link = lane.link
        ring, slot = self._take_slot()
        local = -1 if ring is None else slot - ring.first_slot
        sent = Task(task.id, task.epoch, task.payload, -1 if ring is None else ring.ring_id, local,
                    0 if ring is None else ring.slot_bytes)
        skipped: list = []
        try:
            wire.send(link.conn, sent)
            while True:
                reply = self._next_reply(link, 1.0)
                if isinstance(reply, SamplesSkipped):
                    skipped.append(reply)
                elif reply is not None and not isinstance(reply, WorkerReady):
                    break
        except (EOFError, OSError):  # the worker process died: restart it, and say so
            self._release(ring, slot)
            return skipped, self._restart(lane, lane_index, generation, task.id)
        if isinstance(reply, WorkerFatal):
            self._release(ring, slot)
            return skipped, reply
        if isinstance(reply, BatchDone) and reply.layout is not None:
            if reply.in_slot:
                from .core import collate

                lease = ring.lease(slot, lambda s: self._release(ring, s))
                reply = reply._replace(layout=collate.inline(reply.layout, lease), in_slot=False)
                return skipped, reply  # the slot comes back when Ray has copied the arrays
            if ring is None or slot >= 0:
                self._grow(reply.nbytes)
        self._release(ring, slot)
        return skipped, reply

    def _take_slot(self) -> tuple[Any, int]:
        with self.ring_lock:
            ring = self.rings[-1] if self.rings else None
            for old in [r for r in self.rings[:-1] if r.idle]:
                self.rings.remove(old)
                old.remove()
            if ring is None or not ring.free:
                return ring, -1
            return ring, ring.free.popleft()

    def _release(self, ring: Any, slot: int) -> None:
        if ring is not None and slot >= 0:
            ring.free.append(slot)  # (a deque: safe from Ray's sending thread)

    def _grow(self, nbytes: int) -> None:
        """A batch came inline (no ring yet, or it outgrew its slot): a ring that holds it."""
        from .core.shm import Ring, round_slot_bytes

        with self.ring_lock:
            current = self.rings[-1] if self.rings else None
            if current is not None and nbytes <= current.slot_bytes:
                return
            ring_id = 0 if current is None else current.ring_id + 1
            first = 0 if current is None else current.first_slot + current.slots
            try:
                self.rings.append(Ring(self.files, ring_id, self.slots, round_slot_bytes(nbytes + nbytes // 4), first))
            except Exception:  # noqa: BLE001 - no room in this node's shm_dir: batches stay inline
                return
            if current is not None:
                current.retired = True

    def kill_lane(self, lane_index: int, generation: int) -> WorkerLost | None:
        """``task_timeout`` on the trainer: end this lane's process now. A call running on it
        answers ``WorkerLost`` (and restarts it); if none was (the task had just finished),
        this call restarts it and answers ``WorkerLost`` itself, so the trainer always learns."""
        lane = self.lanes[lane_index]
        lane.link.kill()
        with lane.turn:  # (after a running call has handled the death)
            if generation <= lane.lost_up_to or generation < lane.generation:
                return None  # reported already, or a newer link uses the lane
            lost = self._restart(lane, lane_index, generation, -1)
            lane.turn.notify_all()
            return lost

    def close(self) -> None:
        """Stop the worker processes and remove every file of this agent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.pool.stop([lane.link for lane in self.lanes])
        finally:
            self.pool.close()
            for ring in self.rings:
                ring.close()
            self.files.remove_all()


@dataclass(frozen=True)
class _AttemptId:
    """What ``LocalWorker.stuck_on`` needs of an attempt: its id."""

    id: int


# --------------------------------------------------------------------------- the trainer's side
class RemoteWorker(WorkerLink):
    """A lane of an agent, as the coordinator sees it.

    Tasks go out as actor calls at once (``put``: Ray queues them; nothing blocks); replies
    arrive in Ray's callback thread, which appends them to ``inbox`` and writes a byte to
    the reply pipe the coordinator's selector watches. The end of the lane (its process
    died, or its agent was lost) writes a byte to the exit pipe.
    """

    def __init__(self, index: int, counters: WorkerCounters, pool: RayPool, agent: _AgentSlot, lane: int,
                 generation: int) -> None:
        super().__init__(index, counters)
        self.pool = pool
        self.agent = agent
        self.lane = lane
        self.generation = generation
        self.seq = 0
        self.inbox: deque[Reply] = deque()
        self.lock = threading.Lock()
        self.closed = False
        self.ended = False
        self.lost_code: int | None = None
        self.lost_index: dict[int, int | None] = {}  # task id -> what it was loading when the lane died
        self.agent_lost = False
        self._reply_r, self._reply_w = _pipe()
        self._exit_r, self._exit_w = _pipe()

    @property
    def pid(self) -> int | None:
        return None  # a process of another machine

    @property
    def exitcode(self) -> int | None:
        return self.lost_code

    def describe(self) -> str:
        node = self.agent.node_id[:12] if self.agent.node_id else "?"
        return f"worker {self.index} (Ray node {node}, agent pid {self.agent.pid}, lane {self.lane})"

    def reply_fd(self) -> int:
        return self._reply_r

    def exit_fd(self) -> int:
        return self._exit_r

    def write_fd(self) -> int:
        return self._exit_r  # never waited on: put() never leaves anything unsent

    def read(self) -> list[Reply] | None:
        _drain(self._reply_r)
        replies = []
        while self.inbox:
            replies.append(self.inbox.popleft())
        return replies if replies or not self.ended else None

    def put(self, message: Any) -> None:
        if message is STOP:
            self.end()  # retiring (autotune is refused with this pool): it leaves
            return
        seq, self.seq = self.seq, self.seq + 1
        self.pool.submit(self, seq, message)

    def flush(self) -> bool:
        return True

    def reap(self) -> None:
        with self.lock:
            self.closed = True
            for fd in (self._reply_r, self._reply_w, self._exit_r, self._exit_w):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def kill(self) -> None:
        self.pool.kill_lane(self)

    def stuck_on(self, attempt: Any) -> int | None:
        return self.lost_index.get(attempt.id)

    def failed_to_start(self) -> bool:
        return False

    @property
    def counts_as_restart(self) -> bool:
        return not self.agent_lost  # a lost agent counts against max_node_restarts instead

    @property
    def usable(self) -> bool:
        """Given tasks only once its agent runs: tasks sent to an agent still starting would wait
        for it in Ray's queue (seconds) while the other agents could run them."""
        return self.ready and super().usable

    # ---- called from Ray's callback thread, or the pool's monitor
    def deliver(self, replies: list[Reply]) -> None:
        """Replies from the agent (Ray's callback thread). A ``WorkerLost`` is not a reply the
        coordinator reads: it ends the lane (what the process was loading is kept for
        ``stuck_on``), after the replies that came before it."""
        with self.lock:
            if self.closed or self.ended:
                return  # a late reply of a lane already given up: its tasks were re-queued
            lost = next((r for r in replies if isinstance(r, WorkerLost)), None)
            self.inbox.extend(r for r in replies if not isinstance(r, WorkerLost))
            if lost is not None:
                self.lost_code = lost.exitcode
                self.lost_index[lost.task_id] = lost.index
                self._end()
            elif any(isinstance(r, WorkerFatal) for r in replies):
                self._end()
            else:
                _poke(self._reply_w)

    def _end(self) -> None:
        self.ended = True
        _poke(self._reply_w)  # (the replies before the end are read first: _on_exit reads them)
        _poke(self._exit_w)

    def end(self, agent_lost: bool = False) -> None:
        """The lane is gone (its agent was lost, or it retires): the coordinator re-queues its tasks."""
        with self.lock:
            if self.closed or self.ended:
                return
            self.agent_lost = agent_lost
            self._end()


@dataclass(eq=False)
class _AgentSlot:
    """One agent, as the pool tracks it."""

    number: int
    handle: Any
    node_id: str = ""
    pid: int | None = None
    files_prefix: str = ""  # of the files it created on its node
    alive: bool = True
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    ping_sent: float | None = None
    pong_at: float = 0.0
    lost_why: str = ""
    target: str | None = None  # the node it was started on (None: Ray chose)


class RayPool(WorkerPool):
    """``nodes`` agents of ``workers`` lanes each; the coordinator's WorkerPool for a Ray cluster."""

    uses_ring = False  # batches come through Ray's object store, not the coordinator's ring
    # A round trip through Ray takes milliseconds: a lane holds more tasks, so that its worker
    # never waits for the next one (they wait in the agent, in order; none in the object store).
    tasks_per_worker = 4

    def __init__(self, backend: Backend, spec_bytes: bytes, workers: int, env: dict[str, str], cache: Any,
                 shm_dir: str) -> None:
        self.backend = backend
        self.workers = workers
        self.env = env
        self.cache = cache
        self.shm_dir = shm_dir
        self.spec_ref = ray.put(spec_bytes)
        self.lock = threading.RLock()
        self.agents: list[_AgentSlot | None] = [None] * backend.nodes
        self.restarts = 0
        self.generations = 0
        self.links: dict[int, RemoteWorker] = {}  # lane index -> its live link
        self.doomed: deque[Any] = deque()  # handles of lost agents, for the monitor to kill
        self.node_table: list[tuple[str, dict]] = []  # (node id, total resources) of alive nodes: the monitor's
        self.node_table_at = 0.0
        self.born = time.monotonic()
        self.events: deque[tuple] = deque(maxlen=1000)  # (t, "lost" / "replacing" / "ready", agent, detail)
        self.closed = False
        self._actor = ray.remote(Agent).options  # (a class per pool: ray.remote wraps it)
        self.store_bytes = ray_nodes.local_object_store()  # read here: admit() runs on the coordinator thread
        try:  # on live nodes, distinct ones where there are enough (ray_nodes.py)
            live = iter(ray_nodes.live_nodes(self._needs()))
            for number in range(backend.nodes):
                self.agents[number] = self._start_agent(number, target=next(live, None))
            self._wait_ready(list(self.agents))
        except BaseException:
            self._kill_all()
            raise
        self._monitor = threading.Thread(target=self._watch, name="procpipe-ray-monitor", daemon=True)
        self._monitor.start()

    # ---- agents
    def _needs(self) -> dict[str, float]:
        """What one agent takes on its node."""
        backend = self.backend
        return {"CPU": self.workers if backend.cpus_per_node is None else backend.cpus_per_node,
                **(backend.resources or {})}

    def _start_agent(self, number: int, lost_on: str = "", target: str | None = None) -> _AgentSlot:
        """A new agent (not waited for), on node ``target`` if given. ``lost_on``: the node its
        predecessor was lost on, which Ray may still count as alive for seconds: the
        replacement goes elsewhere if it can."""
        backend = self.backend
        cpus = self._needs()["CPU"]
        options: dict[str, Any] = dict(num_cpus=cpus, resources=dict(backend.resources or {}), max_restarts=0,
                                       max_task_retries=0, max_concurrency=self.workers * 8 + 8,
                                       scheduling_strategy="SPREAD")  # agents on different nodes where they fit
        if lost_on:
            used = {a.node_id for a in self.agents if a is not None and a.alive} | {lost_on}
            target = ray_nodes.spare_node(self.node_table, self._needs(), used)
        if target is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(target, soft=True)
        handle = self._actor(**options).remote(self.spec_ref, self.workers, self.env, self.cache, self.shm_dir,
                                               backend.start_method, backend.start_timeout)
        return _AgentSlot(number, handle, target=target)

    def _wait_ready(self, agents: list[_AgentSlot]) -> None:
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
                    answer = ray.get(ref, timeout=_CALL_TIMEOUT_S)
                except ray.exceptions.RayError as exc:
                    again = self._start_again(agent, exc, tried)
                    pending[again.handle.node.remote()] = again
                    continue
                self._started(agent, *answer)
        if pending:
            backend = self.backend
            cpus = self.workers if backend.cpus_per_node is None else backend.cpus_per_node
            raise NodeLostError(
                f"procpipe: {len(pending)} of {len(agents)} Ray agent(s) did not start within start_timeout="
                f"{backend.start_timeout} s. Each needs num_cpus={cpus} and resources={backend.resources or {}} on "
                f"one node; the cluster has {ray.available_resources()} available. Add nodes, lower "
                "Backend(nodes=...) or cpus_per_node, or raise start_timeout.")

    def _start_again(self, agent: _AgentSlot, exc: BaseException, tried: set[str]) -> _AgentSlot:
        """``agent`` died before it answered: a new one on a live node not tried yet (its own
        start failing, or no such node, raises: that would fail again)."""
        if (not isinstance(exc, ray.exceptions.RayActorError) or exc.actor_init_failed
                or len(tried) > self.backend.nodes + len(self.agents)):
            raise RuntimeError(f"procpipe: a Ray agent could not start ({_START_FAILED}): {exc}") from exc
        _kill(agent.handle)
        tried.add(agent.target or "")
        used = {a.node_id for a in self.agents if a is not None and a.ready} | tried
        target = next(iter(ray_nodes.live_nodes(self._needs(), exclude=used)), None)
        self._event("replacing", agent.number, f"it died before it answered: {exc}"[:200])
        again = self.agents[agent.number] = self._start_agent(agent.number, target=target)
        return again

    def _agent(self, number: int) -> _AgentSlot:
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
                    "Backend(max_node_restarts=...).")
            self.restarts += 1
            self._event("replacing", number)
            replacement = self._start_agent(number, agent.node_id if agent else "")
            self.agents[number] = replacement
            return replacement

    def _started(self, agent: _AgentSlot, node_id: str, pid: int, prefix: str) -> None:
        """``agent`` answered: its lanes' tasks now run (their time counts from here)."""
        with self.lock:
            agent.node_id, agent.pid, agent.files_prefix, agent.ready = node_id, pid, prefix, True
            self._event("ready", agent.number, node_id)
            lanes = [link for link in self.links.values() if link.agent is agent]
        for link in lanes:
            link.deliver([WorkerReady(pid)])

    def _lose(self, agent: _AgentSlot, why: str) -> None:
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
            link.ready = agent.ready  # else its WorkerReady comes when the agent answers (_started)
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
        self._lose(link.agent, f"{type(exc).__name__}: {exc}")
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
            except Exception:  # noqa: BLE001 - already gone
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
                _kill(agent.handle)
        while self.doomed:
            _kill(self.doomed.popleft())

    def admit(self, batch_bytes: int, in_flight: int) -> None:
        """Fail early if the batches in flight would not fit the object store of this node."""
        store = self.store_bytes
        needed = batch_bytes * (in_flight + 1)
        if store and needed > store * 0.8:
            raise ObjectStoreError(
                f"procpipe: a batch is {batch_bytes / 2**20:.1f} MiB and the loader keeps up to {in_flight + 1} in "
                f"flight ({needed / 2**20:.0f} MiB), but this node's Ray object store holds "
                f"{store / 2**20:.0f} MiB (80 % usable before Ray spills to disk). Use a smaller batch_size or "
                "prefetch, fewer workers or nodes, or start Ray with a larger --object-store-memory.")

    def info(self) -> dict[str, Any]:
        """``stats()["backend"]``: the agents now (node, pid, started), agents replaced so far,
        and the events of agent losses and starts, ``(seconds since the pool started, what,
        agent number, detail)``, in order; ``started``: when the pool started (``time.monotonic()``)."""
        with self.lock:
            agents = [None if a is None else {"number": a.number, "node": a.node_id, "pid": a.pid, "ready": a.ready,
                                              "alive": a.alive, "files": a.files_prefix} for a in self.agents]
            return {"kind": "ray", "started": self.born, "nodes": self.backend.nodes, "workers_per_node": self.workers, "agents": agents,
                    "restarts": self.restarts, "events": list(self.events)}

    def _event(self, what: str, number: int, detail: str = "") -> None:
        self.events.append((round(time.monotonic() - self.born, 4), what, number, detail))

    def close(self) -> None:
        self.closed = True
        if self._monitor.is_alive() and threading.current_thread() is not self._monitor:
            self._monitor.join(2.0)

    # ---- heartbeats
    def _watch(self) -> None:
        """Ping every agent about once a second; one silent for ``node_timeout`` seconds is lost.
        Also kills the agents declared lost (a silent one may still be running somewhere)."""
        pending: dict[Any, _AgentSlot] = {}
        while not self.closed:
            try:
                self._watch_once(pending)
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failure (it logs, goes on)
                logger.exception("procpipe.ray: the agent monitor failed one round; it goes on")
                time.sleep(_PING_EVERY_S)

    def _watch_once(self, pending: dict[Any, _AgentSlot]) -> None:
        """One round of ``_watch``."""
        timeout = self.backend.node_timeout
        while self.doomed:
            _kill(self.doomed.popleft())
        now = time.monotonic()
        if now - self.node_table_at >= _NODES_EVERY_S:  # where replacements may go (read here, not
            self.node_table_at = now                   # on the coordinator thread)
            self.node_table = [(n["NodeID"], dict(n.get("Resources", {}))) for n in ray.nodes() if n.get("Alive")]
        for agent in list(self.agents):
            if agent is None or not agent.alive:
                continue
            if not agent.ready:  # a replacement, starting: ask where it runs (its answer: started)
                if agent.ping_sent is None:
                    self._ask(agent, "node", pending, now)
                elif now - agent.started > self.backend.start_timeout:
                    self._lose(agent, f"it did not start within start_timeout={self.backend.start_timeout} s: "
                                      "no node had room for it")
            elif agent.ping_sent is None and now - agent.pong_at >= _PING_EVERY_S:
                self._ask(agent, "ping", pending, now)
            elif agent.ping_sent is not None and now - agent.ping_sent > timeout:
                self._lose(agent, f"no heartbeat for {timeout} s (node_timeout)")
        for ref in [r for r, a in pending.items() if not a.alive]:
            del pending[ref]
        if not pending:
            time.sleep(_PING_EVERY_S / 2)
            return
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=_PING_EVERY_S / 2)
        for ref in ready:
            agent = pending.pop(ref)
            try:
                answer = ray.get(ref, timeout=_CALL_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - actor died, node lost, or it could not start
                why = f"{type(exc).__name__}: {exc}"
                self._lose(agent, why if agent.ready else f"{_START_FAILED}: {why}")
                continue
            if not agent.ready:
                self._started(agent, *answer)
            agent.ping_sent = None
            agent.pong_at = time.monotonic()

    def _ask(self, agent: _AgentSlot, method: str, pending: dict[Any, _AgentSlot], now: float) -> None:
        """Call ``agent.<method>()`` (``node`` or ``ping``); its answer is awaited in ``pending``."""
        try:
            pending[getattr(agent.handle, method).remote()] = agent
        except Exception as exc:  # noqa: BLE001 - the actor handle is dead already
            self._lose(agent, f"{type(exc).__name__}: {exc}")
            return
        agent.ping_sent = now


def _batch_error(task: Task, exc: BaseException) -> BatchFailed:
    """The error of a batch the agent could not run or send back (``RayTaskError``): raised in
    the batch's place, as a reply that does not unpickle is locally."""
    import traceback

    text = (f"the Ray agent could not run or return the batch of task {task.id} (a sample Ray cannot "
            f"serialize, or a failure in procpipe's agent): {exc}")
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return BatchFailed(task.id, ErrorInfo(None, None, "builtins.RuntimeError", text, tb), 0.0)


def _kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _pipe() -> tuple[int, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except (BlockingIOError, OSError):
        pass  # already readable (pipe full), or closed


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass
