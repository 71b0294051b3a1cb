"""Producing one batch: the user's Python for each index, then collation.

The one implementation of "load these indices into a batch", shared by the worker
processes and by ``workers=0`` (the calling process), so both give identical results.
What to do with a failing sample is the caller's: with ``spec.skip`` the sample is left
out and reported in ``Produced.skipped``; otherwise its exception propagates, and
``scope.index`` still names the failing index (it is ``None`` when collation failed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import collate
from .rng import SampleScope


@dataclass
class Produced:
    layout: list | None  # None: every sample was skipped
    nbytes: int
    in_slot: bool
    kept: list[int]  # the indices in the batch
    skipped: list[tuple[int, Exception]]  # (index, exception) left out (spec.skip)


def produce(spec: Any, scope: SampleScope, epoch: int, indices: list[int], buffer: Any | None,
            capacity: int, status: Any | None = None) -> Produced:
    """Run ``fn(source[i])`` for each index under its sample scope, then collate.

    Arrays go straight into ``buffer`` (a ring slot of ``capacity`` bytes) when they fit,
    else inline. ``status``, if given, receives the index being loaded (``status[1]``),
    so the coordinator can name a stuck sample.
    """
    samples, kept, skipped = [], [], []
    source, fn = spec.source, spec.fn
    for index in indices:
        if status is not None:
            status[1] = index
        scope.enter(epoch, index)
        try:
            sample = source[index]
            if fn is not None:
                sample = fn(sample)
        except Exception as exc:
            if not spec.skip:
                raise
            skipped.append((index, exc))
            continue
        samples.append(sample)
        kept.append(index)
    scope.leave()
    if status is not None:
        status[1] = -1
    if not samples:
        return Produced(None, 0, False, kept, skipped)
    if not spec.batched:
        layout, nbytes, in_slot = collate.layout_value(samples[0], buffer, capacity)
    elif spec.collate_fn is not None:
        layout, nbytes, in_slot = collate.layout_value(spec.collate_fn(samples), buffer, capacity)
    else:
        layout, nbytes, in_slot = collate.layout_batch(samples, kept, buffer, capacity)
    return Produced(layout, nbytes, in_slot, kept, skipped)
