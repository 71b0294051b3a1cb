"""Producing one task: the user's Python for each sample, then collation.

``produce`` is what a worker (and ``workers=0``, the calling process) runs per task, so both
give identical results; it hands the task to the source kind's reader (``spec.producer``,
worker_spec.py ``Producer``), resolved once by the Loader: ``produce_indices`` here for a list of indices, or
``ShardProducer.produce_block`` for a stream's block. Both run each sample through the one
per-sample pipeline (stages.py ``run_sample``). What to do with a failing sample is the
pipeline's: with ``spec.skip`` the sample is left out and reported in ``Produced.skipped``;
otherwise its exception propagates, and ``scope.index`` still names the failing index (it is
``None`` when collation or ``batch_fn`` failed).

The stages, per sample then per batch::

    sample = cache.get(i) or cache.compute(i)   # cache=...: fn(source[i]) once per index
             (else fn(source[i]))               # under the sample's scope (sample_rng)
    sample = augment(sample)                    # augment=..., every epoch, sample_rng() allowed
    batch  = collate(samples)                   # default stacking, or collate_fn
    batch  = batch_fn(batch)                    # batch_fn=..., batch_rng() allowed
    -> arrays packed into the ring slot

Without ``batch_fn`` the default collation stacks samples straight into the slot; with
it, the batch is collated privately (new arrays), transformed, then packed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from .._core import collate
from .._core.notes import add_note
from .._core.rng import BatchScope, SampleScope, no_sample_rng
from ..errors import summarize_indices
from .stages import run_indices
from .worker_spec import Produced, WorkerSpec

_NO_SAMPLE_RNG_IN_BATCH_FN = (
    "procpipe.sample_rng() was called inside batch_fn, which works on a whole batch, not one sample: "
    "use procpipe.batch_rng() there (seeded from (seed, epoch, the batch's first index or record)), or draw "
    "per-sample randomness in fn or augment."
)


def produce(
    spec: WorkerSpec,
    scope: SampleScope,
    epoch: int,
    task: Any,
    buffer: Any | None,
    capacity: int,
    status: Any | None = None,
) -> Produced:
    """Produce one task into ``buffer`` (a ring slot of ``capacity`` bytes; inline where it
    does not fit), as the source kind's reader does it (``spec.producer``, worker_spec.py ``Producer``): a
    list of indices (``produce_indices``), or a stream's ``Block`` (``ShardProducer.produce_block``).
    ``status``, if given, receives the index being loaded (``status[1]``), so the coordinator
    can name a stuck sample."""
    return spec.producer.produce(spec, scope, epoch, task, buffer, capacity, status)


def produce_indices(
    spec: WorkerSpec,
    scope: SampleScope,
    epoch: int,
    indices: list[int],
    buffer: Any | None,
    capacity: int,
    status: Any | None = None,
) -> Produced:
    """An indexed source's task: each index through the stages (``stages.run_indices``) under its
    sample scope, then collation (and ``batch_fn``)."""
    skipped: list[tuple[Any, Exception]] = []
    samples, kept = run_indices(spec, scope, epoch, indices, status, skipped)
    if status is not None:
        status[1] = -1
    if not samples or not spec.batched or (spec.batch_fn is None and spec.collate_fn is None):
        scope.leave()  # no user code runs on the batch
        if not samples:
            return Produced(None, 0, False, kept, skipped)
        if not spec.batched:
            layout, nbytes, in_slot = collate.layout_value(samples[0], buffer, capacity)
        else:
            layout, nbytes, in_slot = collate.layout_batch(samples, kept, buffer, capacity, made_in(spec))
        return Produced(layout, nbytes, in_slot, kept, skipped)
    scope.collating(epoch, indices[0])  # draws in collate_fn / batch_fn: the same with or without workers
    if spec.batch_fn is not None:
        batch = run_batch_fn(
            spec, epoch, indices[0], collate_privately(spec.collate_fn, samples, kept), summarize_indices(indices)
        )
    else:
        batch = cast("Callable[[list[Any]], Any]", spec.collate_fn)(samples)  # (one of the two is set: above)
    scope.leave()
    layout, nbytes, in_slot = collate.layout_value(batch, buffer, capacity)
    return Produced(layout, nbytes, in_slot, kept, skipped)


def made_in(spec: WorkerSpec) -> str:
    """Where a sample is made, as collation errors name the place to fix it: the ``fn`` of a
    Loader that has one, else the dataset's ``__getitem__`` (procpipe.torch.DataLoader's case)."""
    return "fn" if spec.fn is not None else "the dataset's __getitem__"


def collate_privately(collate_fn: Callable[[list], Any] | None, samples: list, keys: Sequence[Any]) -> Any:
    """``samples`` as one batch outside any ring slot: ``collate_fn``'s, else the default
    stacking into new arrays (so ``batch_fn`` may change them in place). ``keys`` name the
    samples in collation errors."""
    if collate_fn is not None:
        return collate_fn(samples)
    return collate.build(collate.layout_batch(samples, keys, None, 0)[0], None)


def run_batch_fn(spec: WorkerSpec, epoch: int, first: Any, batch: Any, what: str) -> Any:
    """``batch_fn(batch)`` with ``batch_rng()`` seeded from ``(seed, epoch, first)`` and
    ``sample_rng()`` refused; an exception gets a note naming the batch (``what``: its
    indices, or a streaming source's records)."""
    try:
        with no_sample_rng(_NO_SAMPLE_RNG_IN_BATCH_FN, BatchScope(spec.seed, epoch, first)):
            return cast("Callable[[Any], Any]", spec.batch_fn)(batch)  # (called only where there is one)
    except Exception as exc:
        add_note(exc, f"procpipe: raised by batch_fn on the batch of {what} (epoch {epoch}).")
        raise
