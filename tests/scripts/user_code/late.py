"""A user's script: classes defined after ``import procpipe`` and after a thread started
(the zygote never saw them), a helper module imported late, nested classes, torch's
IterableDataset with a Generic base of the script, and a collate_fn and worker_init_fn of
__main__ through the DataLoaders. ``python late.py METHOD`` (corpus.py)."""

import sys
import threading
from typing import Generic, TypeVar

import numpy as np
import torch

import procpipe  # noqa: F401 - the zygote is forked here: nothing below exists in it

stop = threading.Event()
threading.Thread(target=stop.wait, name="user-metrics", daemon=True).start()  # a thread of the program's

import late_helpers  # noqa: E402 - imported after procpipe on purpose
from corpus import Pattern, run  # noqa: E402

S = TypeVar("S")


# 12. A __main__ class subclassing a late-imported helper class, defined after the thread started.
class LateAugment(late_helpers.Augment):
    def __call__(self, x):
        return super().__call__(x) * 2


class LateSet(torch.utils.data.Dataset):
    def __init__(self):
        self.augment = LateAugment(1)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.augment(np.array([i, -i]))


# 13. Classes nested in a class, used by the dataset's methods.
class Outer:
    class Settings:
        factor = 7

        class Inner:
            @staticmethod
            def bump(x):
                return x + 1

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.Settings.Inner.bump(i * self.Settings.factor)


# 14. An IterableDataset with a Generic base of the script, split between workers by worker info.
class Stream(torch.utils.data.IterableDataset, Generic[S]):
    def __init__(self, n):
        self.n = n

    def values(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return range(start, self.n, step)

    def __iter__(self):
        return iter(np.int64(v * 3) for v in self.values())


# 15. A collate_fn and a worker_init_fn of __main__ (closures over a module constant).
LABEL = "batch"


def collate(samples):
    return {LABEL: torch.as_tensor(np.stack(samples)), "count": len(samples)}


def init_worker(worker_id):
    np.random.seed(worker_id)


PATTERNS = [
    Pattern("late_classes_and_helper_module", LateSet()),
    Pattern("nested_classes", Outer()),
    Pattern("iterable_generic_script_base", Stream(8), loader=False),
    Pattern("collate_fn_and_worker_init_fn", LateSet(), loader=False,
            facade={"collate_fn": collate, "worker_init_fn": init_worker}),
]

if __name__ == "__main__":
    run(PATTERNS, sys.argv[1])
    stop.set()
