"""How messages name a source kind's samples and tasks: an indexed sample by its index, a stream's
record by ``(shard, record)``. Each kind chooses its names (``SourceKind.names``); ``workers=0``'s one
driver (``_consumer/inline.py``) asks them, and needs no code per kind.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..errors import summarize_indices


class NamedTask(Protocol):
    """What a name needs of a task (the engine's ``Job``: this package sits below the engine)."""

    @property
    def seq(self) -> int: ...

    @property
    def payload(self) -> Any: ...


class SampleNames(Protocol):
    """How messages name a source kind's samples and tasks (``workers=0``'s notes and skip logs)."""

    def sample(self, key: Any, job: NamedTask) -> str:
        """A sample ``on_error="skip"`` left out: ``key`` (an index, or a record's key) of task ``job``."""
        ...

    def task(self, job: NamedTask, loading: Any) -> str:
        """Where an error was raised: task ``job``, while loading sample ``loading`` (None: after, collating)."""
        ...


class IndexNames:
    """An indexed source's samples are named by their index, a task by its batch's indices."""

    def sample(self, key: Any, job: NamedTask) -> str:
        return f"index {key} (batch {job.seq})"

    def task(self, job: NamedTask, loading: Any) -> str:
        return f"loading index {loading}" if loading is not None else f"collating {summarize_indices(job.payload)}"


class RecordNames:
    """A stream's records are named by ``(shard, record)``, a task by its block."""

    def sample(self, key: Any, job: NamedTask) -> str:
        return f"record {key[1]} of shard {key[0]} ({job.payload})"

    def task(self, job: NamedTask, loading: Any) -> str:
        return f"loading {job.payload}"


__all__ = ["IndexNames", "NamedTask", "RecordNames", "SampleNames"]
