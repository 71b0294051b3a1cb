"""What every worker is given (``WorkerSpec``), and what it asks of its source kind and its cache.

A Loader makes its spec once (``WorkerSpec.of``, _consumer/assembly.py), sets its cache once
(``with_cache``: the cache is opened from the spec, cache.py ``open_cache``), and ships it to
every worker (spec_shipping.py; with ``"fork"`` it is inherited). Nothing changes it after: it is
frozen. Its parts are typed by what a worker asks of them:

- ``Producer``: the source kind's worker side (``spec.producer``), resolved once by the Loader
  (_sources/resolve.py): how a task is produced (a list of indices: index_producer.py ``IndexProducer``; a
  stream's ``Block``: the configured ``Shards``) and how ``cache=...`` is laid out for it
  (``cache_kind``: ``PER_INDEX``, ``PER_RECORD`` or ``GROWING``);
- ``SampleCache``: ``fn``'s output kept once per index or record (cache.py ``Cache``, or a
  growing stream's stream_cache.py ``StreamCache``);
- ``Produced``: one task's result, as ``produce.produce`` returns it.

This module imports neither cache.py nor produce.py (both import it): no circle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

if TYPE_CHECKING:
    from .._core.rng import SampleScope
    from ..config import Batching, Faults, Stages

#: ``Producer.cache_kind``: how ``cache=...`` lays its file out for the source (never saved).
CacheKind = Literal["per index", "per record", "growing"]
PER_INDEX: Final = "per index"  # one entry per index (cache.py)
PER_RECORD: Final = "per record"  # one per record of a stream with lengths (cache.py, ``ShardProducer.cache_index``)
GROWING: Final = "growing"  # a stream without lengths: chunks appended as records arrive (stream_cache.py)


@dataclass
class Produced:
    """One task, produced (``produce.produce``): its layout, where it is, and its samples' fate."""

    layout: list | None  # None: every sample was skipped
    nbytes: int
    in_slot: bool
    # The indices in the batch; a streaming source's block (``ShardProducer.produce_block``): its records'
    # ``RecordKey``s (tuples). Sequence: read only, and covariant (a ``list[RecordKey]`` fits).
    kept: Sequence[int | tuple[int, int]]
    skipped: Sequence[tuple[int | tuple[int, int], Exception]]  # (index or key, exception) left out (spec.skip)


class Producer(Protocol):
    """What a worker (or ``workers=0``) asks of the source kind it reads (``spec.producer``)."""

    @property
    def cache_kind(self) -> CacheKind:
        """``PER_INDEX``, ``PER_RECORD`` or ``GROWING``: the layout of ``cache=...``'s file."""
        ...

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
        """One task (a list of indices, or a stream's ``Block``) into ``buffer`` (``produce.produce``)."""
        ...

    def cache_length(self) -> int:
        """The entries of the cache (indices, or records of every shard)."""
        ...

    def first_cached(self, spec: WorkerSpec) -> tuple[Any, Any]:
        """``(cache index, fn's output)`` of the first sample, computed in the calling process to
        lay the cache out."""
        ...

    def first_keyed(self, spec: WorkerSpec) -> tuple[Any, Any] | None:
        """A growing cache's first entry (``cache_kind`` ``GROWING``: a stream without lengths):
        ``(record key, fn's output)`` of its first record, computed in the calling process with a
        worker's epoch-0 seeding; None if every shard is empty. Other producers raise ``TypeError``."""
        ...

    def close_readers(self) -> None:
        """Close what this process holds open to read tasks (``workers=0``: when an iteration ends)."""
        ...


class SampleCache(Protocol):
    """``cache=...`` as the stages use it (``spec.cache``): ``fn``'s output per index (cache.py
    ``Cache``) or per record key (a growing stream's stream_cache.py ``StreamCache``)."""

    def get(self, key: Any) -> Any | None:
        """A private copy of the stored sample ``key``, or None if it is not stored yet."""
        ...

    def put(self, key: Any, sample: Any) -> None:
        """Store ``sample`` as ``key`` (``CacheError`` if it does not match the first sample's layout)."""
        ...

    def compute(self, key: Any, source: Any, fn: Any) -> Any:
        """``fn(source[key])``, stored, and the stored copy returned."""
        ...

    def info(self) -> dict[str, Any]:
        """``Loader.cache_info()``."""
        ...

    def close(self) -> None:
        """In the process that created it: release its file. Idempotent."""
        ...

    def shard_end(self, shard: int) -> int | None:
        """A stream's record count of ``shard`` once a reader reached its end (None: not known)."""
        ...

    def set_end(self, shard: int, records: int) -> None:
        """Store that ``shard`` has ``records`` records (a growing stream's cache)."""
        ...


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs, shipped once per worker (spec_shipping.py ``ShippedSpec`` for
    non-fork starts). Frozen: made once (``of``), its cache set once (``with_cache``)."""

    source: Any  # what the user passed (what shipping errors name)
    producer: Producer  # the source kind's worker side: how a task is read, the cache laid out
    fn: Callable[[Any], Any] | None
    collate_fn: Callable[[list[Any]], Any] | None
    batched: bool
    seed: int
    skip: bool = False  # on_error="skip": leave a failing sample out instead of failing the batch
    batch_fn: Callable[[Any], Any] | None = None  # batch_fn(batch) -> batch, after collation (produce.py)
    augment: Callable[[Any], Any] | None = None  # augment(sample) -> sample, every epoch, after fn or the cache
    seed_globals: str | None = "task"  # seed random/np.random/torch per task or sample (rng.seeding_mode)
    cache: SampleCache | None = None  # fn's output per index or record, computed once (cache.py open_cache)

    @classmethod
    def of(cls, source: Any, producer: Producer, stages: Stages, batching: Batching, faults: Faults) -> WorkerSpec:
        """The spec of a Loader over ``source`` (read by ``producer``, its kind's: _sources/resolve.py)
        from the groups of its configuration (config.py); without its cache (``with_cache``)."""
        return cls(
            source=source,
            producer=producer,
            fn=stages.fn,
            collate_fn=stages.collate_fn,
            batched=batching.batch_size is not None,
            seed=int(batching.seed),
            skip=faults.skip,
            batch_fn=stages.batch_fn,
            augment=stages.augment,
            seed_globals=stages.seeding,
        )

    def with_cache(self, cache: SampleCache | None) -> WorkerSpec:
        """This spec with its cache (cache.py ``open_cache``'s; None: none): set once, before it is shipped."""
        return dataclasses.replace(self, cache=cache)
