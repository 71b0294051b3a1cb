"""The small Shards source of the save/load tests (tests/test_nodes.py), in a module of its own.

A Loader over ``Shards(SHARDS, open_shard)`` ships ``open_shard`` to its workers by
reference, so each worker imports the module that defines it. Defined in a test module
that imports torch, that import cost each worker seconds whenever the workers are not
forked from the test process itself (from the zygote once a thread runs in it, as in the
full suite after the Keras and Ray tests): this module imports nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

SHARDS = [(0, 7), (1, 0), (2, 9), (3, 12), (4, 2)]  # (shard id, records): 30 records


def open_shard(shard: tuple[int, int]) -> Iterator[int]:
    """The records of ``shard``: ``id * 100 + i`` for each of its ``i``."""
    for i in range(shard[1]):
        yield shard[0] * 100 + i
