"""One sample through the user's stages: the one per-sample pipeline of every source kind.

An indexed source's batch (``produce.produce_indices``) and a stream's block
(``_sources.stream.shard_producer.ShardProducer.produce_block``) differ in how they get their samples (``source[i]``,
or the next record of a shard's iterator) and in how they name them (an index, or a
``RecordKey``), not in what happens to each sample next::

    sample = cache.get(i) or cache.compute(i, source, fn)   # cache=...: fn's output, once per sample
             (else fn(source[i]))                           # the cached stage under its own seed
    sample = augment(sample)                                # every epoch, sample_rng() allowed
    a None sample is refused (default collation), and
    on_error="skip": a failing sample is left out and reported, else its exception propagates

So that is written once, here, and both call ``run_sample`` per sample: the same order of
stages, the same seeding of the cached stage (``SampleScope.own_seed``), the same skip rule.
The caller has entered the sample's scope (``scope.enter``) before, as the source's own read
draws from it too (a stream's iterator). The hot loop calls it once per sample: it does no
allocation of its own on the way through.

An indexed task goes through ``run_indices``, which calls ``run_sample`` per index, except in
the most common case, where ``fn`` is the only stage (no ``cache``, no ``augment``,
``on_error="raise"``): there ``run_sample`` reduces to ``fn(source[i])`` and the None check,
and ``fn_only`` runs exactly that in its loop, without a call per sample (a fifth of the
cost of a 64-int task; ``tests/test_kinds.py`` checks both give the same samples and errors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._core.notes import add_note
from .._core.rng import SampleScope

if TYPE_CHECKING:
    from .worker_spec import WorkerSpec

#: ``run_sample``'s result for a sample ``on_error="skip"`` left out (its exception is in ``skipped``).
SKIPPED: Any = object()


def run_sample(
    spec: WorkerSpec,
    scope: SampleScope,
    index: Any,
    source: Any,
    key: Any,
    skipped: list[tuple[Any, Exception]],
    name: Callable[[Any], str] | None = None,
    cached: Any = None,
) -> Any:
    """``source[index]`` through the stages (module doc); ``SKIPPED`` if ``on_error="skip"`` left it out.

    ``index``: the sample's index in ``source`` and in the cache; ``key``: how errors and
    ``skipped`` name it (an indexed source: the index again; a stream: its ``RecordKey``, with
    ``source`` a one-record mapping). ``name(key)``, if given, describes the sample in a note
    added to its exception ("raised by fn on record 3 of shard 0 (...)"). ``cached``: the
    sample already read from the cache (a stream's block served from the cache): only
    ``augment`` and the checks run.
    """
    stage = "fn"
    try:
        if cached is not None:
            sample = cached
        elif spec.cache is not None:
            sample = spec.cache.get(index)
            if sample is None:
                with scope.own_seed():  # the task's draws go on as if the cache had been hit
                    sample = spec.cache.compute(index, source, spec.fn)
        else:
            sample = source[index]
            if spec.fn is not None:
                sample = spec.fn(sample)
        if spec.augment is not None:
            stage = "augment"
            sample = spec.augment(sample)
        if sample is None and spec.batched and spec.collate_fn is None:
            raise TypeError(returned_none(spec, key))
    except Exception as exc:
        if name is not None:
            add_note(exc, f"procpipe: raised by {stage} on {name(key)}.")
        if not spec.skip:
            raise
        skipped.append((key, exc))
        return SKIPPED
    return sample


def run_indices(
    spec: WorkerSpec,
    scope: SampleScope,
    epoch: int,
    indices: list[int],
    status: Any,
    skipped: list[tuple[Any, Exception]],
) -> tuple[list[Any], list[int]]:
    """Each of an indexed task's ``indices`` through the stages, in its sample scope:
    ``(samples, the indices kept)``; ``status[1]`` (if given) names the index being loaded."""
    source = spec.source
    if spec.cache is None and spec.augment is None and not spec.skip:
        return fn_only(spec, scope, epoch, indices, source, status), indices
    samples, kept = [], []
    for index in indices:
        if status is not None:
            status[1] = index
        scope.enter(epoch, index)
        sample = run_sample(spec, scope, index, source, index, skipped)
        if sample is SKIPPED:
            continue
        samples.append(sample)
        kept.append(index)
    return samples, kept


def fn_only(
    spec: WorkerSpec, scope: SampleScope, epoch: int, indices: list[int], source: Any, status: Any
) -> list[Any]:
    """``run_sample`` for each index where ``fn`` is the only stage: ``fn(source[i])``, a None
    refused, an exception propagated as it is (module doc)."""
    fn = spec.fn
    refuse_none = spec.batched and spec.collate_fn is None
    samples = []
    for index in scope.each(epoch, indices):
        if status is not None:
            status[1] = index
        sample = source[index] if fn is None else fn(source[index])
        if sample is None and refuse_none:
            raise TypeError(returned_none(spec, index))
        samples.append(sample)
    return samples


def returned_none(spec: WorkerSpec, key: Any) -> str:
    """The error for a sample that is ``None``: which stage returned nothing."""
    stage = "augment" if spec.augment is not None else "fn" if spec.fn is not None else "the source's __getitem__"
    return (
        f"{stage} returned None for index {key}: a sample must be a value (an array, a number, a "
        f"dict or tuple of them); did {stage} forget a `return`? (To drop samples, raise in fn with "
        "on_error='skip'; to batch None values on purpose, pass a collate_fn.)"
    )
