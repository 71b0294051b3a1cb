"""The errors ``procpipe.ray`` raises to the user (beyond a batch's own error)."""

from __future__ import annotations


class NodeLostError(RuntimeError):
    """Agents were lost more often than ``Backend(max_node_restarts=...)`` allows, or none could start."""


class ObjectStoreError(RuntimeError):
    """The batches the loader keeps in flight would not fit in the Ray object store."""
