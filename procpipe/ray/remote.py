"""The trainer's side of the agents: an agent as the pool tracks it (``AgentSlot``) and a
lane of it as the coordinator sees it (``RemoteWorker``, an _engine/pool.py ``WorkerLink``).

Tasks go out as actor calls at once (the pool's ``submit``); replies come back on Ray's
callback thread (``deliver``), which wakes the coordinator through a wake pipe.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray

from .._core.messages import STOP, Reply, Task, WorkerFatal, WorkerLost
from .._core.stats import WorkerCounters
from .._core.wakeup import WakePipe
from .._engine.pool import WorkerLink


class LaneCalls(Protocol):
    """What a lane asks of its pool (``RayPool``): its tasks sent, its process killed."""

    def submit(self, link: RemoteWorker, seq: int, task: Task) -> None: ...

    def kill_lane(self, link: RemoteWorker) -> None: ...


class RemoteWorker(WorkerLink):
    """A lane of an agent, as the coordinator sees it.

    Tasks go out as actor calls at once (``put``: Ray queues them; nothing blocks); replies
    arrive in Ray's callback thread, which appends them to ``inbox`` and writes a byte to
    the reply pipe the coordinator's selector watches. The end of the lane (its process
    died, or its agent was lost) writes a byte to the exit pipe.
    """

    def __init__(
        self, index: int, counters: WorkerCounters, pool: LaneCalls, agent: AgentSlot, lane: int, generation: int
    ) -> None:
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
        self.replies = WakePipe()  # a reply (or the end) is in the inbox
        self.exits = WakePipe()  # the lane ended

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
        return self.replies.fileno()

    def exit_fd(self) -> int:
        return self.exits.fileno()

    def write_fd(self) -> int:
        return self.exits.fileno()  # never waited on: put() never leaves anything unsent

    def read(self) -> list[Reply] | None:
        self.replies.drain()
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
            self.replies.close()
            self.exits.close()

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
                self.replies.wake()

    def _end(self) -> None:
        self.ended = True
        self.replies.wake()  # (the replies before the end are read first: _on_exit reads them)
        self.exits.wake()

    def end(self, agent_lost: bool = False) -> None:
        """The lane is gone (its agent was lost, or it retires): the coordinator re-queues its tasks."""
        with self.lock:
            if self.closed or self.ended:
                return
            self.agent_lost = agent_lost
            self._end()


@dataclass(eq=False)
class AgentSlot:
    """One agent, as the pool tracks it."""

    number: int
    handle: Any
    node_id: str = ""
    pid: int | None = None
    files_prefix: str | None = None  # of the files it created on its node (None: anonymous memory)
    alive: bool = True
    ready: bool = False
    started: float = field(default_factory=time.monotonic)
    ping_sent: float | None = None
    pong_at: float = 0.0
    lost_why: str = ""
    target: str | None = None  # the node it was started on (None: Ray chose)


def kill_agent(handle: Any) -> None:
    """End an agent now (Ray does not restart it); one already gone is no error."""
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001, S110 - already gone
        pass
