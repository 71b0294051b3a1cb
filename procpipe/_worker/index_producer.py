"""The worker side of a source kind: how a task is read, and how the cache is laid out for it.

A Loader resolves its source's kind once (``procpipe._sources.resolve``) and puts the kind's
*reader* in the ``WorkerSpec`` it ships to every worker (``spec.producer``: worker_spec.py
``Producer``), so that nothing in a worker asks again which kind of source it holds. Two readers exist:

- ``IndexProducer`` (here): an indexed dataset (``len`` and ``source[i]``), a ``procpipe.Mix``
  of them, or a torch map-style ``Dataset``: a task is a list of indices
  (``produce.produce_indices``), the cache has one entry per index.
- ``ShardProducer`` (``_sources/stream/shard_producer.py``), a ``procpipe.Shards``' (the torch facade's
  ``IterableDataset`` replicas are one): a task is a ``Block`` of a shard, the cache is keyed by
  ``(shard, record)``: laid out for every record (``lengths`` known), else growing as records
  arrive (``stream_cache.py``).

Both run each sample through the one per-sample pipeline (``stages.run_sample``). This is the
idea of Grain's ``RandomAccessDataSource`` beside its iterator datasets: the engine holds a
protocol (worker_spec.py ``Producer``), never a type test.
"""

from __future__ import annotations

from typing import Any

from .._core.notes import add_note
from .._core.rng import SAMPLE, SampleScope, no_sample_rng
from .cache_file import NO_RNG
from .produce import produce_indices
from .worker_spec import PER_INDEX, CacheKind, Produced, WorkerSpec

_FIRST_SAMPLE_TRIES = 16  # with on_error="skip": indices tried in the parent to size the cache


class IndexProducer:
    """The reader of an indexed source: tasks are lists of indices, read with ``source[i]``."""

    cache_kind: CacheKind = PER_INDEX

    def __init__(self, source: Any) -> None:
        self.source = source

    def produce(
        self,
        spec: WorkerSpec,
        scope: SampleScope,
        epoch: int,
        task: Any,
        buffer: Any,
        capacity: int,
        status: Any = None,
    ) -> Produced:
        return produce_indices(spec, scope, epoch, task, buffer, capacity, status)

    def cache_length(self) -> int:
        return len(self.source)

    def close_readers(self) -> None:
        """Nothing to close: an indexed source is read with ``source[i]``."""

    def first_keyed(self, spec: WorkerSpec) -> tuple[Any, Any] | None:
        """An indexed source's cache is laid out per index (``first_cached``), never grown."""
        raise TypeError("an indexed source's cache is laid out per index (first_cached), not grown")

    def first_cached(self, spec: WorkerSpec) -> tuple[int, Any]:
        """The first index whose cached stage succeeds (``on_error="skip"``: among the first 16)."""
        scope = first_scope(spec)
        error: Exception | None = None
        for index in range(min(len(self.source), _FIRST_SAMPLE_TRIES if spec.skip else 1)):
            scope.enter(0, index)
            try:
                with no_sample_rng(NO_RNG):
                    sample = self.source[index]
                    if spec.fn is not None:
                        sample = spec.fn(sample)
                return index, sample
            except Exception as exc:
                add_note(
                    exc,
                    f"procpipe: raised in the calling process while computing index {index} to lay out "
                    "the cache (cache=...): the first sample of the cached stage is computed when the "
                    "Loader is created.",
                )
                error = exc
                if not spec.skip:
                    raise
            finally:
                scope.leave()
        assert error is not None
        raise error


def first_scope(spec: WorkerSpec) -> SampleScope:
    """The scope the first sample is computed in: the global generators seeded as a worker
    seeds a cached stage for epoch 0 (from its sample's own seed: ``SampleScope.own_seed``),
    and the caller's states put back after."""
    return SampleScope(spec.seed, seed_globals=SAMPLE if spec.seed_globals else None, restore_globals=True)


def first_record_cached(spec: WorkerSpec, scope: SampleScope, found: tuple[Any, Any, Any]) -> tuple[Any, Any]:
    """A stream's ``first_cached``: ``found`` is ``(cache index, key, record)`` of its first
    record (``ShardProducer.first_record``, read in ``scope``, a ``first_scope(spec)``); returns the
    index and ``fn`` of the record."""
    index, key, record = found
    scope.enter(0, key)
    try:
        with no_sample_rng(NO_RNG):
            return index, record if spec.fn is None else spec.fn(record)
    except Exception as exc:
        add_note(
            exc,
            "procpipe: raised in the calling process while computing the first record to lay out the "
            "cache (cache=...): the first sample of the cached stage is computed when the Loader is created.",
        )
        raise
    finally:
        scope.leave()
