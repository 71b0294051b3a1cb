"""procpipe on a Ray cluster: preprocessing on remote CPU nodes, with procpipe's guarantees.

``Loader(..., backend=procpipe.ray.Backend(nodes=2))`` runs the user's Python on Ray nodes
instead of this machine. Everything else stays where it is: the sampler, the coordinator,
ordered / sloppy reassembly, resume bookkeeping and the device stage run in the training
process, exactly as with local workers; only the worker pool is remote (``RayPool``, the
second implementation of _engine/pool.py's ``WorkerPool``)::

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
  workers see it gone, remove the files and exit (_worker/process.py).

Every wait on a remote result has a timeout: replies come back through callbacks, agent
starts are bounded by ``start_timeout``, heartbeats by ``node_timeout``, ``close()`` by a
few seconds. Import this package only where Ray is installed (``pip install procpipe[ray]``);
``import procpipe`` never imports it.

The package's modules, one job each: `backend` (`Backend`, its options in `options`),
`pool` (`RayPool`), `remote` (the trainer's view of an agent and of its lanes), `agent`
(the `Agent` actor), `monitor` (heartbeats, lost agents), `nodes` (the cluster's live
nodes), `errors`.
"""

from __future__ import annotations

from ..errors import NodeLostError, ObjectStoreError
from .backend import Backend
from .ray_pool import RayPool

__all__ = ["Backend", "NodeLostError", "ObjectStoreError", "RayPool"]
