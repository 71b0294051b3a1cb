"""The ``Agent``: a Ray actor on one node, running procpipe's local worker pool and a ring there.

The trainer's ``RayPool`` (ray_pool.py) calls ``run(lane, generation, seq, task)`` concurrently
(a threaded actor); each lane is one local worker process, serving its calls one at a time in
the order the trainer sent them. The batch is written into a slot of the agent's own ring
(_core/rings.py's ``RingSet``, the coordinator's too: grown when a batch outgrows its slot) and sent back inline,
as views of the slot that Ray copies into its object store; then the slot is free again.
A worker process that dies is restarted here before its death is reported (``WorkerLost``).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from .._core.messages import BatchDone, Reply, SamplesSkipped, Task, WorkerFatal, WorkerLost
from .._core.rings import RingSet
from .._core.stats import EpochCounters, WorkerCounters


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

    def __init__(
        self,
        spec_bytes: bytes,
        workers: int,
        env: dict[str, str],
        cache: Any,
        shm_dir: str | None,
        start_method: str,
        start_timeout: float,
    ) -> None:
        import dill

        from .._core.shm import Segments
        from .._engine.start import local_pool
        from .._worker.cache import open_cache
        from ..config import EngineConfig

        self.segments = Segments(shm_dir)
        spec = dill.loads(spec_bytes)
        spec = spec.with_cache(open_cache(spec, cache, self.segments, workers=True))  # this node's own
        config = EngineConfig(workers=workers, start_method=start_method, worker_env=env)  # (what local_pool reads)
        self.pool = local_pool(config, spec, cache, self.segments, own_session=True)
        self.start_timeout = start_timeout
        self.lanes = [_Lane(self.pool.start(i, WorkerCounters())) for i in range(workers)]
        for lane in self.lanes:  # an agent that answers has every worker ready: tasks' time runs from there
            self._wait_ready(lane.link)
        # each lane's running batch, and the one Ray is still sending; no ring until a batch tells its size
        self.rings = RingSet(self.segments)
        self.first_slots = 2 * workers + 2
        self.ring_counters = EpochCounters()  # (what take and grow record: the trainer keeps the stats)
        self.ring_lock = threading.Lock()  # take and grow: from the lanes' calls, run concurrently
        self.closed = False

    @staticmethod
    def _next_reply(link: Any, timeout: float) -> Any:
        """The worker's next message, or None after ``timeout`` seconds; ``EOFError`` once it died."""
        from multiprocess.connection import wait

        from .._core import wire

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
        from .._core.messages import WorkerReady

        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            try:
                reply = self._next_reply(link, 1.0)
            except EOFError:
                break
            if isinstance(reply, WorkerReady):
                return
            if isinstance(reply, WorkerFatal):
                raise RuntimeError(  # noqa: TRY004 - a worker that failed to start, not a wrong argument type
                    f"a procpipe worker on this node could not load the dataset, fn or collate_fn:\n{reply.traceback}"
                )
        raise RuntimeError(
            f"a procpipe worker on this node did not start (exit code {link.exitcode}) within "
            f"start_timeout={self.start_timeout} s; its traceback, if any, is in the node's Ray logs"
        )

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

    def node(self) -> tuple[str, int, str | None]:
        """(Ray node id, pid, files prefix: None where its shared memory is anonymous): where this agent
        runs and what it created there;
        answering it means the agent and its workers are up."""
        return ray.get_runtime_context().get_node_id(), os.getpid(), self.segments.prefix

    def ping(self) -> bool:
        return not self.closed

    def run(self, lane_index: int, generation: int, seq: int, task: Task) -> tuple[list[SamplesSkipped], Reply]:
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

    def _run(self, lane: _Lane, lane_index: int, generation: int, task: Task) -> tuple[list[SamplesSkipped], Reply]:
        import select

        from .._core.messages import WorkerReady

        link = lane.link
        with self.ring_lock:
            rings = self.rings
            if rings.retired:
                rings.remove_idle()
            taken = rings.take(self.ring_counters)
            slot = -1 if taken is None else taken
            had_ring = rings.current is not None
        ring = self.rings.ring_of(slot) if slot >= 0 else None
        sent = (
            Task(task.id, task.epoch, task.payload, -1, -1, 0)
            if ring is None
            else Task(task.id, task.epoch, task.payload, ring.ring_id, slot - ring.first_slot, ring.slot_bytes)
        )
        skipped: list[SamplesSkipped] = []
        try:
            if ring is not None:
                link.map_ring(ring)  # (its segment goes ahead of the first task that names it)
            link.put(sent)
            while not link.flush():  # (through the link's outbox, as the MapRing: in order)
                select.select([], [link.write_fd()], [], 1.0)
            if link.outbox.broken:
                raise EOFError
            while True:
                reply = self._next_reply(link, 1.0)
                if isinstance(reply, SamplesSkipped):
                    skipped.append(reply)
                elif reply is not None and not isinstance(reply, WorkerReady):
                    break
        except (EOFError, OSError):  # the worker process died: restart it, and say so
            self.rings.release_unused(slot)
            return skipped, self._restart(lane, lane_index, generation, task.id)
        if isinstance(reply, WorkerFatal):
            self.rings.release_unused(slot)
            return skipped, reply
        if isinstance(reply, BatchDone) and reply.layout is not None:
            if reply.in_slot and ring is not None:  # (a worker writes into a slot only when given one)
                from .._core import collate

                lease = ring.lease(slot, self.rings.release)
                reply = reply._replace(layout=collate.inline(reply.layout, lease), in_slot=False)
                return skipped, reply  # the slot comes back when Ray has copied the arrays
            if not had_ring or slot >= 0:  # (not when every slot was busy: that is no size to grow to)
                self._grow(reply.nbytes)
        self.rings.release_unused(slot)
        return skipped, reply

    def _grow(self, nbytes: int) -> None:
        """A batch came inline (no ring yet, or it outgrew its slot): a ring that holds it."""
        with self.ring_lock:  # (no room in this node's shm_dir: batches stay inline, as grow says)
            self.rings.grow(nbytes, self.ring_counters, self.first_slots)

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
            self.rings.close()
            self.segments.remove_all()


@dataclass(frozen=True)
class _AttemptId:
    """What ``LocalWorker.stuck_on`` needs of an attempt: its id."""

    id: int
