"""Streaming sources: shards that are read in order, not indexed, interleaved like tf.data.

``Shards(shards, open_fn, cycle_length=4, block_length=None)`` is a source made of a list
of shards (file paths, URLs, anything picklable) and ``open_fn(shard) -> iterable of
records``. An epoch reads every shard once, ``cycle_length`` shards at a time, taking
``block_length`` records from each in turn (tf.data's ``interleave``). User docs:
README.md, section "Streaming sources: shards and parallel interleave".

How it fits the engine (everything else is reused as it is: workers, ring slots,
collation, leases, the coordinator's loop, worker-death recovery):

- The unit of work is a **block**: "records ``b*B .. b*B+B-1`` of shard ``s``" (``Block``),
  sent to a worker in place of a list of indices. ``produce.produce`` hands it to
  ``ShardProducer.produce_block`` (the workers' producer, holding a copy of the source), which
  reads the records from the shard's iterator, runs ``fn`` on each under its sample scope, and
  collates them into the task's ring slot. A block with fewer than ``B`` records (possibly
  none) is the shard's last.
- **Shard affinity.** A worker keeps each shard's iterator open between blocks (``OpenShard``,
  opened by ``Shards.open_shard``), and the coordinator sends a shard's blocks to the worker
  that opened it, so reading stays sequential. Any worker can still run any block: one without
  the shard open (the replacement of a dead worker) opens it again and skips the records
  before the block. Re-running a block is therefore safe as long as ``open_fn`` yields the
  same records every time, which is what makes worker deaths and ``task_timeout`` work here.
- ``ShardPlan`` is the per-epoch plan (``procpipe._sources.epoch_plan.EpochPlan``) of a stream, where an
  indexed source has an ``IndexPlan`` (a fixed list of batches): it opens shards as others
  end (at most ``cycle_length`` at once), offers their blocks, each in its shard's lane
  (the engine sends it to the worker reading that shard), and turns results into what the
  consumer gets (``completed``). Its length is discovered as it goes: the epoch ends when
  every shard has delivered its last block.
- **Order.** ``ordered=True``: ``Interleave`` replays tf.data's deterministic interleave
  one block at a time (a reorder buffer keyed by ``(shard position, block)``).
  ``ordered=False``: blocks are used as they arrive.
- **Batching** (``Output``): by default, blocks are cut and joined into batches of exactly
  ``batch_size`` records, in stream order; a batch inside one block is a zero-copy view of
  its slot, one that spans blocks is copied. With ``collate_fn`` or ``batch_fn`` (which
  run in the worker, on one block's records) batches never span blocks.
  ``shuffle_buffer=N`` mixes records through a buffer of N records in the loader's
  process (tf.data's ``shuffle``).
- **Resume** (``Loader.state_dict``): each batch carries the record ranges it holds; when
  the consumer takes it, they go into the epoch's ``StreamProgress`` (complete shards,
  the ordered interleave's cursor, record ranges received). A resumed epoch leaves the
  complete shards out, restarts the interleave at the cursor (or each shard at its
  first block not entirely received), and its blocks skip the records received: the
  worker advances the shard's iterator past them without running ``fn``.

- **The indexed features, per record**: ``Shards(lengths=...)`` gives ``len()`` and is a
  promise the reader checks (``ShardLengthError``); ``cache=`` keys ``fn``'s output by
  ``(shard, record)`` (``ShardProducer.cache_index``; without ``lengths`` a cache that grows as
  records arrive, _worker/stream_cache.py) and serves fully cached blocks without
  reading their shard; ``on_error="skip"`` leaves out records whose ``fn``/``augment``
  raised (the block's layout names them); ``speculate`` races a block on another worker,
  which reopens the shard and skips ahead (``Shards.replayable``).

Modules, in the order a block meets them on the data path:

- ``shard_order.py``: what the Loader uses: ``ShardOrder`` (where an IndexOrder would be: checks,
  block layout, each epoch's shard order); ``workers=0`` is the Loader's one inline
  driver (procpipe/_consumer/inline.py), for every source kind.
- ``shard_plan.py``: an epoch's plan (``ShardPlan``, ``BlockWork``): opening shards,
  offering blocks by lane, turning results into batches; pure (no processes).
- ``shards.py``: the source (``Shards``): the user's spec, and the hooks a subclass overrides
  (``open_shard``, ``reading``, ``worker_for``, ``reopening``, ``check_cache``).
- ``blocks.py``: a record's identity (``RecordKey``), the task (``Block``) and a block's reply layout.
- ``shard_producer.py``: reading a block in any process (``ShardProducer``, the workers'
  producer; ``OpenShard``, a shard kept open between blocks), and the block layouts
  (``STACK``, ``CHUNKS``, ``RECORDS``).
- ``interleave.py``: the order blocks are used in (``Interleave``) and what the consumer has
  received of an epoch (``StreamProgress``).
- ``block_batching.py``: blocks into batches in the loader's process, and the shuffle buffer
  (``Output``).
"""

from .blocks import Block, RecordKey
from .interleave import Interleave, StreamProgress
from .shard_order import ShardOrder
from .shard_plan import ShardPlan
from .shard_producer import ShardProducer
from .shards import Shards

__all__ = ["Block", "Interleave", "RecordKey", "ShardOrder", "ShardPlan", "ShardProducer", "Shards", "StreamProgress"]
