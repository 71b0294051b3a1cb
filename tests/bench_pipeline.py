"""Pipelines for tests/test_bench.py and the bench's docs (``--pipeline tests.bench_pipeline:factory``)."""
import numpy as np

from procpipe import Loader
from procpipe.bench.workloads import CpuDataset, TinyDataset


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


def dataloader_settings():
    """procpipe.torch.DataLoader arguments as a training script has them: persistent_workers,
    pin_memory, prefetch_factor, a sampler, and its own num_workers (the bench sets num_workers;
    torch takes persistent_workers and prefetch_factor only with workers: the bench leaves them
    out at 0 workers and says so). docs/benchmarks.md ("Your own pipeline") names it."""
    import torch

    dataset = CpuDataset(320)  # about 2 ms of pure Python per sample: workers pay off
    return {
        "dataset": dataset,
        "batch_size": 16,
        "sampler": torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(0)),
        "num_workers": 4,
        "persistent_workers": True,
        "pin_memory": True,
        "prefetch_factor": 4,
        "drop_last": True,
    }


class _Broken:
    def __len__(self):
        return 16

    def __getitem__(self, i):
        raise ValueError(f"cannot decode sample {i}")


def broken():
    """A pipeline whose dataset raises: the bench reports it as the pipeline's error, no traceback."""
    return {"source": _Broken(), "batch_size": 4}
