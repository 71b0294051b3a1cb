"""Turning samples into batches, straight into a ring slot, and back into arrays.

A worker describes each batch with a *layout*: the batch's tree (dicts, tuples, lists)
whose array leaves are ``(dtype, shape, offset)`` records pointing into the slot, and
whose other leaves (lists of str, bytes, arbitrary objects) travel inline in the small
control message. The consumer turns the layout back into the same tree with arrays that
are zero-copy views of the slot.

Layout nodes are short lists, cheap to pickle:

- ``[ARRAY, dtype, shape, offset]``: an array in the slot; ``dtype`` is the dtype's
  string (``'<f4'``, ``'>i4'``: cheap to pickle) when that string says all of it, else
  the ``np.dtype`` itself (structured and subarray dtypes, whose ``.str`` is only ``'|V8'``);
  ``[ARRAY, dtype, shape, offset, torch_dtype]`` for a stack of torch tensors, given back
  as a tensor (sharing the slot's memory; ``torch_dtype`` names a dtype numpy lacks, ""
  if none: procpipe._core.tensors);
- ``[INLINE, value]``: a value carried in the message (objects, or arrays that did not
  fit their slot);
- ``[DICT, keys, children]``, ``[SEQ, type, children]``: containers.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import CollateError, summarize_indices
from . import classref
from .shm import ALIGN
from .tree import ARRAY, DICT, INLINE, SEQ, path_str, seq_type

_NUMBER_TYPES = (bool, int, float, complex, np.number, np.bool_)


def tensor_type() -> type | None:
    """``torch.Tensor`` if this process has imported torch (procpipe never imports it for this)."""
    return getattr(sys.modules.get("torch"), "Tensor", None)


def _as_tensor(array: np.ndarray, torch_dtype: str) -> Any:
    from .tensors import named_tensor  # only reached for batches of tensors: torch is there

    return named_tensor(array, torch_dtype)


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array of shape {value.shape} and dtype {value.dtype}"
    return f"{type(value).__name__}"


class _Planner:
    """Builds a layout and the list of array writes it needs, before any byte moves."""

    def __init__(self, made_in: str = "fn") -> None:
        self.writes: list[tuple[list, Any, bool]] = []  # (node, source, stack_it)
        self.nbytes = 0
        self.made_in = made_in  # where the messages say to fix a sample: "fn", or "the dataset's __getitem__"

    def _array_node(self, dtype: np.dtype, shape: tuple, source: Any, stack_it: bool) -> list:
        node = [ARRAY, _dtype_token(dtype), shape, None]
        self.nbytes += -(-(math.prod(shape) * dtype.itemsize) // ALIGN) * ALIGN
        self.writes.append((node, source, stack_it))
        return node

    # -- stacking samples into a batch (the default collate) --------------------------
    def stack(self, values: list, path: tuple, indices: Sequence[object]) -> list:
        first = values[0]
        if isinstance(first, Mapping):
            keys = tuple(first.keys())
            for v, i in zip(values, indices, strict=False):
                if not isinstance(v, Mapping) or (tuple(v.keys()) != keys and set(v.keys()) != set(keys)):
                    got = (
                        _describe(v)
                        if not isinstance(v, Mapping)
                        else "a mapping with keys " + str(sorted(map(str, v.keys())))
                    )
                    raise CollateError(
                        f"cannot collate {path_str(path)}: index {indices[0]} is a mapping with keys "
                        f"{sorted(map(str, keys))} but index {i} is {got}. "
                        "Every sample must have the same structure; pass collate_fn=... to combine them yourself."
                    )
            return [DICT, keys, [self.stack([v[k] for v in values], path + (k,), indices) for k in keys]]
        if isinstance(first, (tuple, list)):
            for v, i in zip(values, indices, strict=False):
                if not isinstance(v, (tuple, list)) or len(v) != len(first):
                    raise CollateError(
                        f"cannot collate {path_str(path)}: index {indices[0]} is a {type(first).__name__} "
                        f"of length {len(first)} but index {i} is {_describe(v)}"
                        f"{' of length ' + str(len(v)) if isinstance(v, (tuple, list)) else ''}. "
                        "Pass collate_fn=... to combine samples of different structure."
                    )
            columns = [self.stack([v[j] for v in values], path + (j,), indices) for j in range(len(first))]
            return [SEQ, seq_type(first), columns]
        if isinstance(first, np.ndarray):
            return self._stack_arrays(values, path, indices)
        if isinstance(first, _NUMBER_TYPES) and not isinstance(first, (str, bytes)):
            return self._stack_numbers(values, path, indices)
        tensor = tensor_type()
        if tensor is not None and isinstance(first, tensor):
            return self._stack_tensors(values, path, indices, tensor)
        return [INLINE, list(values), True]  # (True: one value per sample, for find_inline)

    def _stack_tensors(self, values: list, path: tuple, indices: Sequence[object], tensor: type) -> list:
        """Stack torch tensors like arrays (through numpy views); they come back as a tensor."""
        from .tensors import dtype_name, tensor_numpy

        arrays, dtypes = [], set()
        for v, i in zip(values, indices, strict=False):
            if not isinstance(v, tensor):
                raise CollateError(
                    f"cannot collate {path_str(path)}: index {indices[0]} is a torch tensor but index {i} is "
                    f"{_describe(v)}. Make the field the same type in every sample, or pass collate_fn=...."
                )
            array, dtype = tensor_numpy(v)
            arrays.append(array)
            dtypes.add(dtype_name(dtype))
        if len(dtypes) > 1:
            raise CollateError(
                f"cannot stack {path_str(path)} for {summarize_indices(indices)}: the tensors have "
                f"different dtypes ({sorted(dtypes)}); cast them in {self.made_in}."
            )
        node = self._stack_arrays(arrays, path, indices)
        node.append(dtypes.pop())
        return node

    def _stack_arrays(self, values: list, path: tuple, indices: Sequence[object]) -> list:
        first = values[0]
        if first.dtype.hasobject:
            raise CollateError(
                f"cannot collate {path_str(path)}: index {indices[0]} is an array of dtype object, "
                "which cannot be placed in shared memory. Convert it to a numeric or fixed-width dtype "
                f"in {self.made_in}, or pass collate_fn=... to build the batch yourself."
            )
        for v, i in zip(values, indices, strict=False):
            if not isinstance(v, np.ndarray) or v.shape != first.shape or v.dtype != first.dtype:
                raise CollateError(
                    f"cannot stack {path_str(path)} for {summarize_indices(indices)}: index {indices[0]} is an "
                    f"{_describe(first)} but index {i} is "
                    f"{'an ' + _describe(v) if isinstance(v, np.ndarray) else 'a ' + _describe(v)}. "
                    "Samples must have equal shapes and dtypes to be stacked; pass collate_fn=... "
                    f"(for example to pad variable-length samples), or resize/cast them in {self.made_in}."
                )
        return self._array_node(first.dtype, (len(values),) + first.shape, values, True)

    def _stack_numbers(self, values: list, path: tuple, indices: Sequence[object]) -> list:
        # Each distinct type checked once (a batch has one or two): a fraction of the cost of
        # an isinstance per sample, which dominates collating a batch of scalars.
        if not all(issubclass(kind, _NUMBER_TYPES) for kind in set(map(type, values))):
            self._refuse_non_number(values, path, indices)
        column = np.asarray(values)
        if column.dtype.hasobject:  # e.g. Python ints beyond 64 bits
            return [INLINE, list(values), True]
        return self._array_node(column.dtype, column.shape, column, False)

    def _refuse_non_number(self, values: list, path: tuple, indices: Sequence[object]) -> None:
        """Raise the error naming the first sample of a column of numbers that is not one."""
        for v, i in zip(values, indices, strict=False):
            if not isinstance(v, _NUMBER_TYPES):
                raise CollateError(
                    f"cannot collate {path_str(path)}: index {indices[0]} is a number "
                    f"({_describe(values[0])}) but index {i} is {_describe(v)}. "
                    "Make the field the same type in every sample, or pass collate_fn=...."
                )

    # -- packing an already-built batch (collate_fn output, or unbatched samples) ------
    def pack(self, value: Any) -> list:
        if isinstance(value, np.ndarray) and not value.dtype.hasobject:
            return self._array_node(value.dtype, value.shape, value, False)
        if isinstance(value, Mapping):
            keys = tuple(value.keys())
            return [DICT, keys, [self.pack(value[k]) for k in keys]]
        if isinstance(value, (tuple, list)):
            return [SEQ, seq_type(value), [self.pack(v) for v in value]]
        tensor = tensor_type()
        if tensor is not None and isinstance(value, tensor):
            from .tensors import dtype_name, tensor_numpy

            array, dtype = tensor_numpy(value)
            if not array.dtype.hasobject:
                node = self._array_node(array.dtype, array.shape, array, False)
                node.append(dtype_name(dtype))
                return node
        return [INLINE, value]

    # -- moving the bytes ----------------------------------------------------------------
    def write(self, buffer: Any | None, capacity: int) -> bool:
        """Write every array into ``buffer``; if it is None or too small, inline them.

        Returns whether the arrays went to the buffer (False means the slow path).
        """
        in_slot = buffer is not None and self.nbytes <= capacity
        offset = 0
        for node, source, stack_it in self.writes:
            dtype = np.dtype(node[1])
            shape = node[2]
            if in_slot:
                out = np.ndarray(shape, dtype, buffer=buffer, offset=offset)
                if stack_it:
                    np.stack(source, out=out)
                else:
                    np.copyto(out, source, casting="no")
                node[3] = offset
                offset += -(-out.nbytes // ALIGN) * ALIGN
            else:  # the produced dtype exactly (np.stack would make a '>i4' column native '<i4')
                out = np.empty(shape, dtype)
                if stack_it:
                    np.stack(source, out=out)
                else:
                    np.copyto(out, source, casting="no")
                node[0] = INLINE
                node[1] = out if len(node) <= 4 else _as_tensor(out, node[4])  # a stack of tensors
                del node[2:]
        return in_slot


def _dtype_token(dtype: np.dtype) -> str | np.dtype:
    """How a layout names ``dtype``: its string where ``np.dtype(string) == dtype`` (the usual
    case, cheap to pickle and to look up), else the dtype object (fields, subarrays, metadata)."""
    token = dtype.str
    return token if dtype.names is None and dtype.subdtype is None and not dtype.metadata else dtype


def layout_batch(
    samples: list, indices: Sequence[object], buffer: Any | None, capacity: int, made_in: str = "fn"
) -> tuple[list, int, bool]:
    """Collate ``samples`` by stacking; returns ``(layout, nbytes, in_slot)``. ``made_in``: where
    the samples were made, which an error names as the place to fix them."""
    planner = _Planner(made_in)
    layout = planner.stack(samples, (), indices)
    return layout, planner.nbytes, planner.write(buffer, capacity)


def layout_value(value: Any, buffer: Any | None, capacity: int) -> tuple[list, int, bool]:
    """Lay out an already-built batch (``collate_fn`` output) or an unbatched sample."""
    planner = _Planner()
    layout = planner.pack(value)
    return layout, planner.nbytes, planner.write(buffer, capacity)


def find_inline(node: list, refuses: Any, path: tuple = ()) -> tuple[tuple, int | None, Any] | None:
    """The first value carried inline in a layout that ``refuses(value)`` (e.g. cannot be pickled),
    as ``(path, position, value)``: its place in the sample (``tree.path_str``), and its sample's
    position in the batch (None for a value of an already-built batch); None if there is none."""
    kind = node[0]
    if kind == ARRAY:
        return None
    if kind == INLINE:
        if not refuses(node[1]):
            return None
        if len(node) == 3 and node[2]:  # a column of stacked samples: which one
            for position, value in enumerate(node[1]):
                if refuses(value):
                    return path, position, value
        return path, None, node[1]
    keys = node[1] if kind == DICT else range(len(node[2]))
    for key, child in zip(keys, node[2], strict=True):
        found = find_inline(child, refuses, path + (key,))
        if found is not None:
            return found
    return None


def describe_path(path: tuple, root: str = "sample") -> str:
    """A place in a sample (or a batch: ``root``), as errors name it: ``sample['image']``, ``sample[0]``."""
    return root + path_str(path).removeprefix("sample")


def find_value(tree: Any, wanted: Callable[[Any], bool], path: tuple = ()) -> tuple[tuple, Any] | None:
    """The first value in ``tree`` (dicts, lists and tuples are walked, anything else is a value)
    for which ``wanted(value)`` holds, as ``(path, value)`` (``describe_path`` names it); None if none.
    For errors only: it walks the whole tree."""
    return _find_value(tree, wanted, path, set())


def _find_value(tree: Any, wanted: Callable[[Any], bool], path: tuple, seen: set[int]) -> tuple[tuple, Any] | None:
    if isinstance(tree, (dict, list, tuple)):
        if id(tree) in seen:  # (a container holding itself)
            return None
        seen.add(id(tree))
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        for key, child in items:
            found = _find_value(child, wanted, path + (key,), seen)
            if found is not None:
                return found
        return None
    return (path, tree) if wanted(tree) else None


def unsendable_error(
    where: str, value: Any, exc: BaseException, made_in: str = "fn", drop_in: str = "batch_fn / collate_fn"
) -> CollateError:
    """The error of a value a worker made that cannot go to the training process: ``where`` it is
    (``sample['h'] of index 5``), what it is, why (``exc``, its pickling error), and the fix: in
    ``made_in``, where the value was made, or ``drop_in``. An open file is named as such: pickled
    by name, it would arrive as a new handle at position 0 (classref.py refuses it)."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    if classref.is_open_file(value):
        name = getattr(value, "name", None)
        return CollateError(
            f"cannot send {where} to the training process: it holds an open file ({kind}"
            f"{'' if name is None else f' {name!r}'}), which procpipe does not send: the training process would "
            f"get a new handle, at position 0, not this one. Return the path (and the position, f.tell()) or the "
            f"bytes read instead, from {made_in}, or drop the field in {drop_in}."
        )
    return CollateError(
        f"cannot send {where} to the training process: it holds "
        f"{'an object' if value is None else f'a {kind}'}, which cannot be pickled "
        f"({type(exc).__name__}: {exc}). Return only picklable values from {made_in} (arrays, numbers, str, "
        f"plain containers: e.g. list(generator) instead of the generator, a path instead of an open "
        f"file), or drop the field in {drop_in}."
    )


def count_arrays(node: list) -> int:
    """How many arrays of a layout are in the slot."""
    kind = node[0]
    if kind == ARRAY:
        return 1
    if kind == INLINE:
        return 0
    return sum(count_arrays(child) for child in node[2])


_dtype_cache: dict[str | np.dtype, np.dtype] = {}


def inline(node: list, buffer: Any) -> list:
    """The same layout with each array leaf replaced by its array (a view of ``buffer``), carried
    inline: for a reply that leaves the machine (procpipe.ray), whose slot the receiver cannot map."""
    kind = node[0]
    if kind == ARRAY:
        return [INLINE, build(node, buffer)]
    if kind == INLINE:
        return node
    return [kind, node[1], [inline(child, buffer) for child in node[2]]]


def build(node: list, buffer: Any | None) -> Any:
    """Turn a layout back into a batch; array leaves become views of ``buffer``."""
    kind = node[0]
    if kind == ARRAY:
        dtype = _dtype_cache.get(node[1])
        if dtype is None:
            dtype = _dtype_cache[node[1]] = np.dtype(node[1])
        array = np.ndarray(node[2], dtype, buffer=buffer, offset=node[3])
        return array if len(node) == 4 else _as_tensor(array, node[4])
    if kind == INLINE:
        return node[1]
    if kind == DICT:
        return dict(zip(node[1], [build(child, buffer) for child in node[2]], strict=True))
    seq_type = node[1]
    items = [build(child, buffer) for child in node[2]]
    if seq_type is list:
        return items
    if seq_type is tuple:
        return tuple(items)
    return seq_type(*items)  # namedtuple
