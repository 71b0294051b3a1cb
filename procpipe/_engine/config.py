"""``EngineConfig``: the engine's slice of a Loader's configuration, resolved.

The Loader's arguments are checked once, in their groups (``_core/config.py``,
``_consumer/config.py``); the engine is given this slice of them: the worker count to start with
(``workers="auto"``: the tuner's first count; a remote backend: every node's lanes), the
start method as resolved, the workers' whole environment, the ring's settings, and the
``Faults`` group as it is. Frozen and keyword-only: nothing is copied by position, and
nothing the coordinator reads changes under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._core.config import Faults

if TYPE_CHECKING:
    from .autotune import AutoWorkers


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """What the coordinator and its pool need from the Loader's configuration.

    Args:
        workers: workers to start (with ``autotune``: the count to begin with).
        start_method: ``"fork"``, ``"zygote"``, ``"forkserver"`` or ``"spawn"`` (never ``"auto"``).
        worker_env: the environment variables set in each worker (the defaults and ``worker_env=``).
        prefetch: ready batches kept ahead of the consumer (ring slots for them).
        slot_bytes: the ring's slot size, or None to size it from the first batch.
        stage_slots: ring slots the consumer's stages may hold (``stage_slots=`` and a device stage's).
        autotune: the ``AutoWorkers`` of ``workers="auto"``, else None.
        faults: the ``Faults`` group (``on_error``, ``max_skipped``, ``task_timeout``, ``speculate``,
            ``max_worker_restarts``).
    """

    workers: int
    start_method: str
    worker_env: dict[str, str] = field(default_factory=dict)
    prefetch: int = 2
    slot_bytes: int | None = None
    stage_slots: int = 0
    autotune: AutoWorkers | None = None
    faults: Faults = field(default_factory=Faults)
