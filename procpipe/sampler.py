"""Which indices each batch of an epoch holds.

The order depends only on ``(seed, epoch)``; batches are consecutive slices of it. This
is the single source of truth for both the worker path and the ``workers=0`` path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .rng import shuffle_rng


@dataclass(frozen=True)
class Sampler:
    """Splits ``range(length)`` into the batches of each epoch.

    ``batch_size=None`` means one sample per batch (yielded unbatched).
    """

    length: int
    batch_size: int | None
    shuffle: bool
    seed: int
    drop_last: bool

    @property
    def step(self) -> int:
        return 1 if self.batch_size is None else self.batch_size

    def __len__(self) -> int:
        if self.drop_last:
            return self.length // self.step
        return -(-self.length // self.step)

    def order(self, epoch: int) -> np.ndarray:
        if self.shuffle:
            return shuffle_rng(self.seed, epoch).permutation(self.length)
        return np.arange(self.length)

    def batches(self, epoch: int) -> list[list[int]]:
        """The index lists of every batch of ``epoch``, in delivery order."""
        order = self.order(epoch).tolist()
        step = self.step
        return [order[i * step:(i + 1) * step] for i in range(len(self))]
