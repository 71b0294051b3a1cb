"""A user's script: class hierarchies in __main__, Generic bases and TypeVars, torch's Dataset
as the base, a tqdm bar running while the loaders work (its monitor thread makes "auto" pick
the zygote). ``python hierarchy.py METHOD`` (corpus.py)."""

import abc
import sys
from typing import Generic, TypeVar

import numpy as np
import torch
from corpus import Pattern, run
from tqdm import tqdm

import procpipe

T = TypeVar("T")
N = TypeVar("N", bound=int)


# 1. The reproduction: a __main__ base reaching typing.Generic, a TypeVar of the script.
class Base(Generic[T]):
    def sample(self, i):
        return i * 10


class DS(Base):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.sample(i)


# 2. torch's Dataset (Generic[T_co]) as the base of a __main__ base with a helper method.
class ImageBase(torch.utils.data.Dataset):
    def __init__(self, size):
        self.size = size

    def flip(self, image):
        return image[:, ::-1].copy()


class SyntheticImages(ImageBase):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        image = np.arange(self.size * self.size, dtype=np.float32).reshape(self.size, self.size) + i
        return self.flip(image)


# 3. A subscripted Generic base with a bound TypeVar, and a mixin before it.
class NormMixin:
    scale = 2

    def norm(self, x):
        return x * self.scale


class Typed(Base[N], Generic[N]):
    def typed(self, i: N) -> N:
        return i


class Mixed(NormMixin, Typed[int]):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return np.array([self.norm(self.typed(i)), self.sample(i)])


# 4. An abstract base, three levels, super().__init__, classmethod, staticmethod, property.
class Abstract(abc.ABC):
    def __init__(self, n):
        self.n = n

    @abc.abstractmethod
    def value(self, i): ...

    def __len__(self):
        return self.n


class Middle(Abstract):
    def __init__(self, n, offset):
        super().__init__(n)
        self.offset = offset

    @property
    def shift(self):
        return self.offset + 1

    @staticmethod
    def square(x):
        return x * x


class Leaf(Middle):
    @classmethod
    def make(cls):
        return cls(8, 100)

    def value(self, i):
        return self.square(i) + self.shift

    def __getitem__(self, i):
        return self.value(i)


# 5. A registry filled by __init_subclass__, read in the worker.
class Registered:
    registry: dict = {}  # noqa: RUF012 - the pattern under test

    def __init_subclass__(cls, key="", **kwargs):
        super().__init_subclass__(**kwargs)
        Registered.registry[key] = cls


class Doubler(Registered, key="double"):
    def apply(self, x):
        return 2 * x


class ByName(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return Registered.registry["double"]().apply(i) + len(Registered.registry)


PATTERNS = [
    Pattern("generic_typevar_hierarchy", DS(), torch_same_method=True),
    Pattern("torch_dataset_base_hierarchy", SyntheticImages(3), torch_same_method=True),
    Pattern("subscripted_generic_mixin", Mixed()),
    Pattern("abstract_three_levels", Leaf.make()),
    Pattern("init_subclass_registry", ByName()),
]

if __name__ == "__main__":
    method = sys.argv[1]
    bar = tqdm(total=len(PATTERNS), desc="patterns", file=sys.stderr)  # its monitor thread runs from here on
    if method == "zygote":  # the case: with tqdm's thread running, "auto" picks the zygote
        with procpipe.Loader(DS(), batch_size=4, workers=2) as loader:
            print(f"auto: {loader.start_method} {[b.tolist() for b in loader]}", flush=True)
    run(PATTERNS, method)
    bar.update(len(PATTERNS))
    bar.close()
