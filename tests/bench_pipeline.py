"""Tiny pipelines for tests/test_bench.py (``--pipeline tests.bench_pipeline:factory``)."""
import numpy as np

from procpipe import Loader
from procpipe.bench.workloads import TinyDataset


def square(i):
    return {"x": np.full(4, i, dtype=np.float32), "y": i}


def factory():
    """Loader keyword arguments; the bench sets ``workers``."""
    return {"source": TinyDataset(96), "fn": square, "batch_size": 8}


def make_loader(workers):
    """A ready Loader, for the bench's other factory form."""
    return Loader(TinyDataset(48), batch_size=8, workers=workers)


def wrong_key():
    """A typo in a Loader argument: the bench must name it and suggest the right one."""
    return {"source": TinyDataset(48), "batchsize": 8}


def facade_kwargs():
    """procpipe.torch.DataLoader arguments: the bench sets num_workers."""
    return {"dataset": TinyDataset(48), "batch_size": 8}
