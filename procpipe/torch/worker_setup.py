"""A procpipe worker made into what torch's DataLoader makes its worker ``id``: one function,
used by both kinds of dataset (``sampling.TorchSource``, ``iterable.Replicas``).

torch's worker loop, step by step (torch's ``_worker_loop``): one intra-op
thread, ``random`` and torch seeded with ``base_seed + id``, numpy with the seed torch derives
from ``(base_seed, id)``, ``get_worker_info()`` set. The caller then runs ``worker_init_fn(id)``
(whose errors each kind reports its own way). So a dataset drawing random numbers draws what
it would draw under torch's DataLoader, when its batches reach the same workers.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["become_torch_worker"]

_MASK64 = (1 << 64) - 1


def become_torch_worker(base_seed: int, worker: int, num_workers: int, dataset: Any) -> int:
    """Set this process up as torch sets up worker ``worker`` of ``num_workers``; returns its
    seed (``get_worker_info().seed``)."""
    torch.set_num_threads(1)
    seed = (base_seed + worker) & _MASK64
    random.seed(seed)
    torch.manual_seed(seed)
    # private torch API (its own worker set-up): the numpy seed and the variable get_worker_info reads
    from torch.utils.data._utils import worker as _torch_worker

    np.random.seed(_torch_worker._generate_state(base_seed, worker))
    _torch_worker._worker_info = _torch_worker.WorkerInfo(
        id=worker, num_workers=num_workers, seed=seed, dataset=dataset
    )
    return seed
