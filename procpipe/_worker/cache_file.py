"""What both caches of ``cache=...`` share: how a sample is laid out in the file, and where the file is.

``Layout`` (its ``Field``s): a cached sample's tree, taken from the first sample (``Layout.of``):
the skeleton (``[DICT, keys, children]``, ``[SEQ, type, children]``, ``[LEAF, field]``) and one
field per leaf (a typed array or number). A later sample is matched against it (``leaves``: the
values to store, or a ``CacheError`` naming what differs), a stored one built back (``build``).
cache.py's ``Cache`` stores a field per array and a row per index; stream_cache.py's
``StreamCache`` a slot of bytes per record.

``Storage``: where a cache's bytes are (``create_storage``: the loader's shared memory, or a file
in the ``cache=`` directory), released by the process that made it (``release_storage``);
``wanted``, ``directory_of``, ``prefix_of`` read the ``cache=`` argument.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from .._core.shm import Segments, SharedFd, check_capacity, close_fd, open_new_file, remove_file
from .._core.tree import DICT, LEAF, SEQ, path_str, seq_type
from ..config import CACHE_IN_MEMORY
from ..errors import CacheError

MEMORY = CACHE_IN_MEMORY  # cache="memory" (checked with the other arguments: config.py)
NO_RNG = (
    "procpipe.sample_rng() was called while computing a cached sample (cache=... is on): the cached "
    "stage (the source's __getitem__ and fn) runs once per index and its output is reused in every "
    "epoch, so it must be deterministic. Move random augmentation into augment=..., which runs every "
    "epoch on top of the cached sample and may use sample_rng()."
)
# Python number types and the dtype they are stored as (restored as the Python type).
_PY_NUMBERS = {
    bool: np.dtype(np.bool_),
    int: np.dtype(np.int64),
    float: np.dtype(np.float64),
    complex: np.dtype(np.complex128),
}


class Field:
    """One leaf of the sample tree: ``kind`` is ``"array"``, ``"scalar"`` (a numpy scalar) or a
    Python number type's name (``"int"``...), restored as that type."""

    __slots__ = ("dtype", "itemsize", "kind", "offset", "path", "shape")

    def __init__(self, kind: str, dtype: np.dtype, shape: tuple, path: tuple) -> None:
        self.kind, self.dtype, self.shape, self.path = kind, dtype, shape, path
        self.itemsize = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.offset = 0

    def __getstate__(self) -> tuple:  # (the dtype itself: its .str would lose a structured dtype's fields)
        return (self.kind, self.dtype, self.shape, self.path, self.offset, self.itemsize)

    def __setstate__(self, state: tuple) -> None:
        self.kind, self.dtype, self.shape, self.path, self.offset, self.itemsize = state

    def describe(self) -> str:
        if self.kind == "array":
            return f"an array of shape {self.shape} and dtype {self.dtype}"
        if self.kind == "scalar":
            return f"a numpy {self.dtype} scalar"
        return f"a Python {self.kind}"


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    if isinstance(value, np.generic):
        return f"a numpy {value.dtype} scalar"
    return f"a {type(value).__name__}"


class Layout:
    """How a cached sample is laid out: the skeleton of its tree (``[DICT, keys, children]``,
    ``[SEQ, type, children]``, ``[LEAF, field]``) and its fields (one per leaf: an array or a
    number), taken from the first sample (``Layout.of``). Both caches store samples by it: this
    module's ``Cache`` (a field per array, a row per index) and a growing stream's
    ``stream_cache.StreamCache`` (a slot of bytes per record). ``leaves`` matches a later sample
    against it (the values to store, field by field, or a ``CacheError`` naming what differs);
    ``build`` makes a sample again from its stored leaves."""

    __slots__ = ("_build", "fields", "skeleton")

    def __init__(self, skeleton: list, fields: list[Field]) -> None:
        self.skeleton = skeleton
        self.fields = fields
        self._build: Callable[[list[Any]], Any] | None = None

    @classmethod
    def of(cls, sample: Any) -> Layout:
        """The layout of ``sample``; ``CacheError`` for a leaf that is neither an array nor a number."""
        fields: list[Field] = []

        def walk(value: Any, path: tuple) -> list:
            if isinstance(value, Mapping):
                keys = tuple(value.keys())
                return [DICT, keys, [walk(value[k], path + (k,)) for k in keys]]
            if isinstance(value, (tuple, list)):
                return [SEQ, seq_type(value), [walk(v, path + (j,)) for j, v in enumerate(value)]]
            if isinstance(value, np.ndarray) and not value.dtype.hasobject:
                fields.append(Field("array", value.dtype, value.shape, path))
            elif type(value) in _PY_NUMBERS:
                if type(value) is int and not -(2**63) <= value < 2**63:
                    raise CacheError(f"cache=... cannot store {path_str(path)} = {value}: it does not fit in int64")
                fields.append(Field(type(value).__name__, _PY_NUMBERS[type(value)], (), path))
            elif isinstance(value, (np.number, np.bool_)):
                fields.append(Field("scalar", value.dtype, (), path))
            else:
                raise CacheError(
                    f"cache=... stores arrays and numbers only, but {path_str(path)} is {_describe(value)}. "
                    "Return only numpy arrays, numbers and dicts/tuples/lists of them from the cached stage (fn), "
                    "e.g. encode labels as ints; add str/bytes/object fields in augment=... (uncached), or pass "
                    "cache=False."
                )
            return [LEAF, len(fields) - 1]

        return cls(walk(sample, ()), fields)

    @property
    def sample_bytes(self) -> int:
        """The bytes of one sample's fields."""
        return sum(f.itemsize for f in self.fields)

    def leaves(self, sample: Any, item: str, unit: str, rule: str) -> list[Any]:
        """The leaves of ``sample`` in field order, each checked against its field; else a
        ``CacheError`` naming the leaf: ``item`` names the sample (``"index 10"``), ``unit`` the
        kind of the first one the layout came from (``"sample"``), ``rule`` whose structure must
        match (``"Every sample of a cached fn"``)."""
        leaves: list[Any] = [None] * len(self.fields)

        def mismatch(path: tuple, expected: str, got: str) -> CacheError:
            return CacheError(
                f"cache=...: {path_str(path)} of {item} is {got}, but the cache was laid out from the first "
                f"{unit}, where it is {expected}. {rule} must have the same structure, dtypes and shapes: make "
                "fn return fixed-shape arrays (resize, crop or pad in fn), or pass cache=False."
            )

        def match(node: list, value: Any, path: tuple) -> None:
            kind = node[0]
            if kind == DICT:
                if not isinstance(value, Mapping) or set(value.keys()) != set(node[1]):
                    raise mismatch(
                        path,
                        f"a mapping with keys {sorted(map(str, node[1]))}",
                        f"a mapping with keys {sorted(map(str, value.keys()))}"
                        if isinstance(value, Mapping)
                        else _describe(value),
                    )
                for key, child in zip(node[1], node[2], strict=True):
                    match(child, value[key], path + (key,))
                return
            if kind == SEQ:
                length = len(node[2])
                if not isinstance(value, (tuple, list)) or len(value) != length:
                    raise mismatch(
                        path,
                        f"a {node[1].__name__} of length {length}",
                        f"a {type(value).__name__} of length {len(value)}"
                        if isinstance(value, (tuple, list))
                        else _describe(value),
                    )
                for j, child in enumerate(node[2]):
                    match(child, value[j], path + (j,))
                return
            field = self.fields[node[1]]
            if field.kind == "array":
                ok = isinstance(value, np.ndarray) and value.shape == field.shape and value.dtype == field.dtype
            else:
                ok = isinstance(value, (bool, int, float, complex, np.number, np.bool_)) and np.can_cast(
                    np.asarray(value).dtype, field.dtype, "safe"
                )
            if not ok:
                raise mismatch(path, field.describe(), _describe(value))
            leaves[node[1]] = value

        match(self.skeleton, sample, ())
        return leaves

    def build(self, values: list[Any]) -> Any:
        """The sample made again from its stored leaves, ``values[n]`` being field ``n``'s (restored).
        (The skeleton is compiled into nested constructors once: a sample is built per read.)"""
        if self._build is None:
            self._build = _builder(self.skeleton)
        return self._build(values)


def _builder(node: list) -> Callable[[list[Any]], Any]:
    """A function making the tree of ``node`` (a ``Layout`` skeleton) from the list of its leaves."""
    kind = node[0]
    if kind == LEAF:
        return operator.itemgetter(node[1])
    parts = [_builder(child) for child in node[2]]
    if kind == DICT:
        keys = node[1]
        return lambda values: dict(zip(keys, [part(values) for part in parts], strict=True))
    seq_type = node[1]
    if seq_type is list:
        return lambda values: [part(values) for part in parts]
    if seq_type is tuple:
        return lambda values: tuple([part(values) for part in parts])
    return lambda values: seq_type(*[part(values) for part in parts])  # namedtuple


class Storage(NamedTuple):
    """Where a cache's bytes are: ``fd``, the descriptor every process of the loader maps; ``path``,
    its file's name (None: anonymous memory); ``label``, how a message names it."""

    fd: SharedFd
    path: str | None
    label: str


def wanted(cache: Any) -> bool:
    """Whether a ``cache=`` argument asks for a cache."""
    return cache is not None and cache is not False


def directory_of(cache: Any) -> str | None:
    """The directory a ``cache=`` argument keeps the cache in; None: the loader's shared memory."""
    if cache is True or cache == MEMORY:
        return None
    return os.fspath(cache)


def prefix_of(cache: Any, segments: Segments) -> str | None:
    """The prefix of the files a loader's cache makes outside its shared memory (a directory
    cache's), for workers to remove if the loader is killed; None: none."""
    directory = directory_of(cache) if wanted(cache) else None
    return None if directory is None else os.path.join(os.path.abspath(directory), segments.token)


def create_storage(cache: Any, segments: Segments, nbytes: int, what: str, fixes: str, growing: bool) -> Storage:
    """A new cache's ``Storage`` of ``nbytes`` (reserved): in the loader's shared memory
    (``segments``: anonymous, or a file in ``shm_dir``), or a file in the ``cache=`` directory;
    ``growing``: it may grow (a stream's cache), else its size is fixed."""
    directory = directory_of(cache)
    if directory is None:
        fd = segments.new("cache", nbytes, what, fixes, growing=growing)
        path = segments.path("cache") if segments.named else None
    else:
        check_capacity(directory, nbytes, what, fixes)
        path = os.path.join(os.path.abspath(directory), segments.token) + "cache"
        fd = open_new_file(path, nbytes, what)
    return Storage(SharedFd(fd), path, f"the cache file {path}" if path else "the cache in shared memory")


def release_storage(storage: Storage, pid: int) -> None:
    """A cache is done with, in the process ``pid`` that created it (a cache's finalizer): its
    descriptor is closed and its file, if any, removed (never from a forked worker that inherited it)."""
    if os.getpid() == pid:
        close_fd(storage.fd.fd)
        if storage.path is not None:
            remove_file(storage.path)  # (and the reaper forgets it)
