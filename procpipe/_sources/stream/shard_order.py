"""What the Loader uses for a streaming source: ``ShardOrder``.

Where it sits in the data path: when its source is a ``Shards`` (shards.py), the Loader
(procpipe/loader.py) builds a ``ShardOrder`` where it would build an IndexOrder. The plan
checks what streaming does not support, decides how workers lay out blocks, gives each
epoch's shard order, and names ``ShardPlan`` (shard_plan.py) as the plan of the epochs
the ``Iteration`` (procpipe/_engine/epochs.py) opens; with workers the coordinator then drives
those epochs like any other. With ``workers=0`` the Loader's one inline driver (procpipe/_consumer/inline.py)
drives the same stream and epochs in the calling thread, reading each block there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from ..._core.checks import check_int, is_count
from ..epoch_order import epoch_order
from .block_batching import BatchingConfig
from .even_ranks import Chunking, RankLimits, even_ranks_unsupported
from .shard_plan import ShardPlan
from .shard_producer import CHUNKS, RECORDS, STACK, ShardProducer

if TYPE_CHECKING:
    from typing_extensions import Self

    from ...config import Batching, Faults, Stages
    from .shards import Shards


class ShardOrder:
    """What a Loader needs for a ``Shards`` source; it stands where the IndexOrder would.

    Checks what streaming does not support and decides how blocks are laid out.
    ``batches(epoch)`` is the epoch's shard order (the ``Iteration`` builds each epoch from it,
    with ``epoch_plan``); ``shards`` is the source (the user's, never changed) and ``producer``
    the workers' side (``ShardProducer``: a copy of it, with the block layout), which the workers
    (or ``workers=0``) read with.
    """

    epoch_plan = ShardPlan

    @classmethod
    def of(cls, source: Any, batching: Batching, stages: Stages, faults: Faults) -> Self:
        """The order of ``source``'s shards, from a Loader's configuration groups (config.py): the
        batching group's order settings, and what a stream's blocks need of the stages
        (``collate_fn``, ``batch_fn``, ``cache``) and the faults (``on_error``, ``max_skipped``,
        ``speculate``)."""
        return cls(
            source,
            batch_size=batching.batch_size,
            shuffle=batching.shuffle,
            seed=batching.seed,
            drop_last=batching.drop_last,
            reshuffle=batching.reshuffle,
            shard=batching.shard,
            shuffle_buffer=batching.shuffle_buffer,
            batches=batching.batches,
            even_ranks=batching.even_ranks,
            collate_fn=stages.collate_fn,
            batch_fn=stages.batch_fn,
            cache=stages.cache,
            on_error=faults.on_error,
            max_skipped=faults.max_skipped,
            speculate=faults.speculate,
        )

    def __init__(
        self,
        shards: Shards,
        *,
        batch_size: int | None,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        reshuffle: bool = True,
        shard: tuple[int, int] | None = None,
        collate_fn: Callable | None = None,
        shuffle_buffer: int | None = None,
        on_error: str = "raise",
        max_skipped: int | float = 0.01,
        speculate: float | None = None,
        batches: Any = None,
        batch_fn: Any = None,
        cache: Any = None,
        even_ranks: bool = False,
    ) -> None:
        unsupported = [
            (batches is not None, "batches=... (its records have no indices to choose from)"),
            (
                speculate is not None and not shards.replayable,
                (
                    f"speculate with a {type(shards).__name__} source (its shards cannot be read again by another "
                    "worker, so a straggling block cannot be raced)"
                ),
            ),
            (
                batch_fn is not None and shuffle_buffer is not None,
                (
                    "batch_fn together with shuffle_buffer (the shuffle buffer puts batches together in the loader's "
                    "process, after the workers, so there is no batch in a worker for batch_fn to run on; apply the "
                    "function to each batch in your loop, or transform records in fn)"
                ),
            ),
        ]
        for bad, what in unsupported + even_ranks_unsupported(even_ranks, shards):
            if bad:
                raise ValueError(f"a streaming source (procpipe.Shards) does not support {what}")
        if shuffle_buffer is not None:
            check_int("shuffle_buffer", shuffle_buffer, 1)
        self.shards = shards
        self.cycle_length = shards.cycle_length
        self.block_length = shards.block_length or batch_size or 1
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.reshuffle = bool(reshuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.shard = None if shard is None else (shard[0], shard[1])  # (validated: a pair)
        self.collate_fn = collate_fn
        self.shuffle_buffer = shuffle_buffer
        self.max_skipped = max_skipped
        if shuffle_buffer is not None or batch_size is None:
            self.mode = RECORDS
        elif collate_fn is not None or batch_fn is not None:
            self.mode = CHUNKS
        else:
            self.mode = STACK
        self.producer = ShardProducer(shards, self.block_length, self.mode, batch_size)  # (its copy: once per loader)
        self.batching = BatchingConfig(self.mode, batch_size, self.drop_last, collate_fn, shuffle_buffer, self.seed)
        self.even_ranks = bool(even_ranks) and self.shard is not None
        self._limits: tuple[int, RankLimits] | None = None  # (epoch, its cut): the last asked for

    def __len__(self) -> int:
        """Batches per epoch, from ``Shards(lengths=...)`` (``TypeError`` without them, or when
        the count changes from epoch to epoch)."""
        lengths = self.shards.lengths
        if lengths is None:
            raise TypeError(
                "a Loader over a streaming source (procpipe.Shards) has no len() unless the shards' "
                "record counts are given: pass Shards(..., lengths=[records of each shard]); without "
                "them the number of records is only known once every shard has been read"
            )
        if self.shard is not None and self.shuffle and self.reshuffle and self.shard[1] > 1 and len(set(lengths)) > 1:
            raise TypeError(
                "a Loader over a streaming source with shard=(rank, world_size), shuffle=True and "
                "shards of different lengths has no len(): each epoch gives this rank a different "
                "set of shards, hence a different number of records (pass reshuffle=False for the "
                "same shards every epoch)"
            )
        return self.batch_count(self.batches(0), self.limits(0))

    def batch_count(self, order: list[int], limits: RankLimits | None = None) -> int:
        """The batches an epoch over the shards ``order`` yields, from their ``lengths`` (or the
        records ``even_ranks`` leaves this rank: ``limits``)."""
        lengths = cast("tuple[int, ...]", self.shards.lengths)  # (known: the callers check)
        size = self.batch_size
        if limits is not None:  # (with CHUNKS, limits count batches)
            return (
                limits.records
                if size is None or self.mode == CHUNKS
                else (limits.records // size if self.drop_last else -(-limits.records // size))
            )
        if size is None:  # one item per record
            return sum(lengths[s] for s in order)

        def batches(records: int) -> int:
            return records // size if self.drop_last else -(-records // size)

        if self.mode == CHUNKS:  # batches never span blocks: a block's last chunk may be smaller
            block = self.block_length
            return sum(lengths[s] // block * batches(block) + batches(lengths[s] % block) for s in order)
        return batches(sum(lengths[s] for s in order))

    def batches(self, epoch: int) -> list[int]:
        """The shards of ``epoch``, in the order they are opened (indices into ``Shards.shards``)."""
        order = epoch_order(
            len(self.shards.shards), epoch, self.shuffle, self.seed, self.reshuffle, self.shard
        ).tolist()
        limits = self.limits(epoch)
        return order if limits is None else limits.order(order)

    def full_order(self, epoch: int) -> Any:
        """The shards of ``epoch`` in order before sharding (rank ``r`` of ``w`` opens ``r, r + w, ...``
        of them; ``even_ranks`` counts every rank's records from it): an int array."""
        return epoch_order(len(self.shards.shards), epoch, self.shuffle, self.seed, self.reshuffle, None)

    def limits(self, epoch: int) -> RankLimits | None:
        """``even_ranks``: the records this rank reads of each shard in ``epoch`` (None without it)."""
        if not self.even_ranks:
            return None
        if self._limits is None or self._limits[0] != epoch:
            order = self.full_order(epoch)
            # (CHUNKS has a batch size; even_ranks, lengths and a shard: checked in __init__)
            chunking = (
                Chunking(self.block_length, cast(int, self.batch_size), self.drop_last) if self.mode == CHUNKS else None
            )
            rank, world = cast("tuple[int, int]", self.shard)
            lengths = cast("tuple[int, ...]", self.shards.lengths)
            self._limits = (epoch, RankLimits(lengths, order, world, rank, chunking))
        return self._limits[1]

    def settings(self) -> dict[str, Any]:
        """What a saved state (``Loader.state_dict``) must match to be resumed with this plan."""
        return {
            "shards": len(self.shards.shards),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "shard": None if self.shard is None else list(self.shard),
            "reshuffle": self.reshuffle,
            "cycle_length": self.cycle_length,
            "block_length": self.block_length,
            "mode": self.mode,
            "shuffle_buffer": self.shuffle_buffer,
            "even_ranks": self.even_ranks,
        }

    def check_progress(self, state: Any, epoch: int) -> dict | None:
        """A saved ``StreamProgress.state()`` of ``epoch`` (or None), checked against this plan's
        shards; raises ``ValueError`` naming what is wrong."""
        if state is None:
            return None
        order = self.batches(epoch)

        def corrupt(what: str) -> ValueError:
            return ValueError(
                f"corrupt procpipe Loader state: the stream progress of epoch {epoch} {what}: {state!r:.300}"
            )

        if not isinstance(state, dict) or set(state) != {"cursor", "complete", "received"}:
            raise corrupt("is not a dict with keys cursor, complete and received")
        in_order = set(order)
        complete = state["complete"]
        if not (
            isinstance(complete, list)
            and all(is_count(s, 0) and s in in_order for s in complete)
            and complete == sorted(set(complete))
        ):
            raise corrupt("has complete shards that are not sorted shards of the epoch")
        received, previous = state["received"], None
        for entry in received if isinstance(received, list) else [None]:
            if not (
                isinstance(entry, list)
                and len(entry) == 3
                and all(is_count(x, 0) for x in entry)
                and entry[0] in in_order
                and entry[0] not in complete
                and entry[1] < entry[2]
                and (previous is None or (previous[0], previous[2]) < (entry[0], entry[1]))
            ):
                raise corrupt(f"has received entry {entry!r} (not [shard, start, stop] ranges, sorted and merged)")
            previous = entry
        if state["cursor"] is not None:
            self._check_cursor(state["cursor"], len(order) - len(complete), corrupt)
        return state

    def _check_cursor(self, cursor: Any, shards: int, corrupt: Callable[[str], ValueError]) -> None:
        slots_expected = max(1, min(self.cycle_length, shards))
        ok = isinstance(cursor, list) and len(cursor) == 3 and is_count(cursor[0], 0) and is_count(cursor[1], 0)
        if ok:
            turn, opened, slots = cursor
            ok = turn < slots_expected and opened <= shards and isinstance(slots, list) and len(slots) == slots_expected
        if ok:
            held = [slot for slot in slots if slot is not None]
            ok = all(
                isinstance(slot, list)
                and len(slot) == 2
                and is_count(slot[0], 0)
                and is_count(slot[1], 0)
                and slot[0] < opened
                for slot in held
            ) and len({slot[0] for slot in held}) == len(held)
        if not ok:
            raise corrupt(
                f"has cursor {cursor!r} (not an interleave over {shards} shards, cycle_length {self.cycle_length})"
            )
