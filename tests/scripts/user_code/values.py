"""A user's script: dataclasses, enums, closures, functools.partial, lambdas in class
attributes, NamedTuple samples, module-level state read by methods, all in __main__.
``python values.py METHOD`` (corpus.py)."""

import dataclasses
import enum
import functools
import sys
from typing import Generic, NamedTuple, TypeVar

import numpy as np
import torch
from corpus import Pattern, run

TABLE = {"offset": 1000}  # module-level state a method reads
WEIGHTS = np.arange(3, dtype=np.int64)


# 6. A frozen dataclass with a default_factory, and a method.
@dataclasses.dataclass(frozen=True)
class Config:
    n: int = 8
    tags: list = dataclasses.field(default_factory=lambda: [1, 2])

    def total(self):
        return sum(self.tags)


@dataclasses.dataclass
class DataclassSet(torch.utils.data.Dataset):
    config: Config

    def __len__(self):
        return self.config.n

    def __getitem__(self, i):
        return i * self.config.total()


# 7. An enum held by the dataset and compared by identity in the worker.
class Mode(enum.Enum):
    TRAIN = 1
    EVAL = 2


class EnumSet:
    def __init__(self, mode):
        self.mode = mode

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.array([i, self.mode is Mode.TRAIN, self.mode.value, Mode["EVAL"].value])


# 8. A closure made by a factory function, held by the dataset and passed as fn.
def make_scale(factor):
    bias = factor + 1

    def scale(x):
        return x * factor + bias

    return scale


class ClosureSet:
    def __init__(self, transform):
        self.transform = transform

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.transform(i)


# 9. functools.partial of a __main__ function, as fn and held by the dataset.
def affine(x, *, mul, add):
    return x * mul + add


# 10. Lambdas in class attributes (a plain one used as a method, a staticmethod one).
class LambdaSet:
    key = lambda self, i: i + 1  # noqa: E731 - the pattern under test
    double = staticmethod(lambda x: 2 * x)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.double(self.key(i))


# 11. A NamedTuple of __main__ as the sample, and module-level state read by the method.
class Row(NamedTuple):
    x: int
    y: int


class RowSet:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        row = Row(i, i + TABLE["offset"])
        return Row(int(row.x * WEIGHTS.sum()), row.y)


# 12. Samples that are instances of a Generic dataclass of __main__: they come back to the script
# as instances of the script's own class (by reference), through a collate_fn of __main__.
V = TypeVar("V")


@dataclasses.dataclass
class Point(Generic[V]):
    x: V
    y: V

    def norm1(self):
        return abs(self.x) + abs(self.y)


class PointSet:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return Point(i, -2 * i)


def as_list(samples):
    return list(samples)


PATTERNS = [
    Pattern("dataclass", DataclassSet(Config())),
    Pattern("enum_identity", EnumSet(Mode.TRAIN)),
    Pattern("closure", ClosureSet(make_scale(3)), fn=make_scale(2)),
    Pattern("functools_partial", ClosureSet(functools.partial(affine, mul=2, add=5)),
            fn=functools.partial(affine, mul=10, add=0)),
    Pattern("lambda_class_attributes", LambdaSet()),
    Pattern("namedtuple_samples_and_globals", RowSet()),
    Pattern("main_class_samples", PointSet(), facade={"collate_fn": as_list}),
]

if __name__ == "__main__":
    run(PATTERNS, sys.argv[1])
