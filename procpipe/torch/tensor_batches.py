"""The torch facade's batches on the wire: samples and ``collate_fn`` results, tensors in the ring.

Two ways a batch travels from a ``procpipe.torch.DataLoader`` worker to the consumer:

- **Default collate** (``collate_fn`` is torch's ``default_collate``): each sample becomes
  what the core stacks (``sample_to_wire``: tensors as numpy views, the leaves torch's
  collate must decide marked as one-field namedtuples), the core collates it straight into
  a ring slot, and the consumer rebuilds ``default_collate``'s batch (``from_default``) as
  tensors sharing the slot's memory.
- **A custom ``collate_fn``, or no batching**: the object is pickled *without* its tensors and
  arrays (pickle's persistent ids, ``pack``), which go through the ring instead; the
  consumer unpickles it around views of them (``unpack``). In the training process itself
  (``num_workers=0``) the object is handed over as is (``InProcess``).
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple, final

import numpy as np
import torch
import torch.utils.data as _tud

from .._ext import DTYPE_NAMES as _DTYPE_NAMES
from .._ext import DillRefPickler, RefPickler, describe_path, find_value, unsendable_error, worker_index
from .._ext import numpy_tensor as _numpy_tensor
from .._ext import tensor_numpy as _tensor_numpy
from ..errors import CollateError, summarize_indices

__all__ = [
    "InProcess",
    "Keyed",
    "Packed",
    "PackingCollate",
    "from_default",
    "pack",
    "pack_for_consumer",
    "sample_to_wire",
    "unpack",
    "unpack_convert",
]

# ---- tensors <-> numpy: procpipe._core.tensors, shared with the core's collation of tensor samples


# Default-collate mode: a sample's special leaves become one-field namedtuples, which the
# core stacks like any namedtuple; the consumer recognises the class.
class _Leaf(NamedTuple):  # str/bytes/None/objects: torch's collate decides
    value: Any


class _MappingOf(NamedTuple):
    """A Mapping that is not a dict: its items, and an empty copy (its class and attributes)
    wrapped in an _Opaque, so the core carries it as is instead of stacking it."""

    template: Any
    items: dict[Any, Any]


def _bits_marker(name: str) -> type[tuple[Any]]:
    """The one-field namedtuple class ``_Bits_<name>`` marking the raw bits of a ``name`` tensor."""

    class _Bits(NamedTuple):
        bits: Any

    _Bits.__name__ = _Bits.__qualname__ = f"_Bits_{name}"
    _Bits.__doc__ = f"_Bits_{name}(bits,)"  # (what the functional NamedTuple form writes)
    _Bits.__module__ = __name__
    return _Bits


_BITS_MARKERS: dict[type, torch.dtype] = {}
_MARKER_OF: dict[torch.dtype, type] = {}
for _dt, _name in _DTYPE_NAMES.items():
    _cls = _bits_marker(_name)
    globals()[_cls.__name__] = _cls  # importable, so it pickles by reference
    _BITS_MARKERS[_cls] = _dt
    _MARKER_OF[_dt] = _cls


class _Opaque:
    """A value the core must carry as is (not walk into, as it would a mapping)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


# ---- default collate: samples in the worker, batches in the consumer -------------------
def sample_to_wire(x: Any) -> Any:
    """A sample as the core stacks it, with what torch's default_collate must decide marked."""
    if isinstance(x, torch.Tensor):
        array, dtype = _tensor_numpy(x)
        return array if dtype is None else _MARKER_OF[dtype](array)
    kind = type(x)
    if kind is np.ndarray:
        return _Leaf(x) if x.dtype.kind in "OSUa" else x  # torch refuses those: let it say so
    if isinstance(x, (int, float, np.number, np.bool_)):
        return x
    if kind is complex:  # the core would stack it; torch's default_collate refuses it
        raise TypeError(_tud._utils.collate.default_collate_err_msg_format.format(kind))
    if kind is dict:
        return {k: sample_to_wire(v) for k, v in x.items()}
    if isinstance(x, Mapping):  # torch's default_collate keeps the class: carry it
        return _MappingOf(_Opaque(_empty_like(x)), {k: sample_to_wire(v) for k, v in x.items()})
    if kind is tuple or kind is list:
        return kind([sample_to_wire(v) for v in x])
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return kind(*(sample_to_wire(v) for v in x))
    return _Leaf(x)


def _empty_like(mapping: Mapping[Any, Any]) -> Any:
    """What default_collate rebuilds a Mapping subclass from: an emptied shallow copy of a
    mutable one (its class and attributes, e.g. a defaultdict's factory), else its class."""
    if isinstance(mapping, MutableMapping):
        try:
            clone = copy.copy(mapping)
            clone.clear()
            return clone
        except Exception:  # noqa: BLE001 - default_collate falls back to a dict too
            return dict
    return type(mapping)


def _rebuild_mapping(template: Any, items: dict[Any, Any]) -> Any:
    """``items`` in the first sample's mapping class, as default_collate does (a dict if it cannot)."""
    try:
        if isinstance(template, MutableMapping):
            clone = copy.copy(template)
            clone.update(items)
            return clone
        return template(items)
    except TypeError:
        return items


def from_default(x: Any, in_sequence: bool = False) -> Any:
    """A core batch of ``sample_to_wire`` samples, as ``default_collate`` would have built it."""
    kind = type(x)
    if kind is np.ndarray:
        return torch.from_numpy(x)
    if kind is dict:
        return {k: from_default(v) for k, v in x.items()}
    if kind is list or kind is tuple:  # torch turns a tuple of columns into a list
        return [from_default(v, True) for v in x]
    if kind is _MappingOf:
        return _rebuild_mapping(x.template[0].value, from_default(x.items))
    if kind is _Leaf:
        # default_collate sees a column as the tuple zip() makes (inside a sequence) or a list.
        values = x.value
        return _tud.default_collate(tuple(values) if in_sequence else list(values))
    dtype = _BITS_MARKERS.get(kind)
    if dtype is not None:
        return _numpy_tensor(x.bits, dtype)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return kind(*(from_default(v, True) for v in x))
    return x


# ---- custom collate_fn / unbatched: pickle the object, its arrays through the ring ----
class Packed(NamedTuple):
    """An object packed by ``pack``: its pickle without the arrays, and the arrays (the core
    carries them in a ring slot, the skeleton as a small value)."""

    skeleton: bytes  # the object pickled with each tensor/array replaced by a reference
    arrays: list[Any]  # those arrays, in the ring


class _RefPickler(RefPickler):
    def __init__(self, file: Any, arrays: list[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays = arrays
        self.seen: dict[int, tuple[Any, ...]] = {}

    def persistent_id(self, obj: Any) -> Any:
        return _persistent_id(self, obj)


def _persistent_id(pickler: Any, obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_quantized:
            return None  # pickled the ordinary way
        ref = pickler.seen.get(id(obj))
        if ref is None:
            array, dtype = _tensor_numpy(obj)
            pickler.arrays.append(array)
            ref = pickler.seen[id(obj)] = (
                "t",
                len(pickler.arrays) - 1,
                _DTYPE_NAMES.get(dtype),
                bool(obj.requires_grad),
            )
        return ref
    if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
        ref = pickler.seen.get(id(obj))
        if ref is None:
            pickler.arrays.append(obj)
            ref = pickler.seen[id(obj)] = ("a", len(pickler.arrays) - 1)
        return ref
    return None


def pack(obj: Any) -> Packed:
    """``obj`` pickled with each CPU tensor and numeric array replaced by a reference into
    ``Packed.arrays`` (classes by reference; dill for lambdas and local classes)."""
    arrays: list[Any] = []
    buffer = io.BytesIO()
    try:
        _RefPickler(buffer, arrays).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError):

        class _DillRefPickler(DillRefPickler):  # lambdas, local classes...
            def persistent_id(self, o: Any) -> Any:
                return _persistent_id(self, o)

        arrays, buffer = [], io.BytesIO()
        pickler = _DillRefPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.arrays, pickler.seen = arrays, {}
        pickler.dump(obj)
    return Packed(buffer.getvalue(), arrays)


class _RefUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, arrays: list[Any]) -> None:
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, ref: Any) -> Any:
        array = self.arrays[ref[1]]
        if ref[0] == "a":
            return array
        tensor = _numpy_tensor(array, None if ref[2] is None else getattr(torch, ref[2]))
        return tensor.requires_grad_() if ref[3] else tensor


@final  # (so that `type(packed) is InProcess` tells a type checker the other case is a Packed)
class InProcess:
    """A ``collate_fn`` result or unbatched sample made in this process (``num_workers=0``):
    handed over as is, so it is the very object (and class) torch's DataLoader would yield."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


_FIX_IN = ("the dataset's __getitem__", "collate_fn")  # unsendable_error's made_in, drop_in: the facade's words


def pack_for_consumer(obj: Any, samples: Sequence[Keyed] = ()) -> Packed | InProcess:
    """``obj`` as it leaves for the consumer: packed in a worker, as is in the consumer's process.

    A value that cannot be sent (an open file, a generator...) raises the ``CollateError`` the
    core raises for one (``unsendable_error``), naming its place: in the sample (of
    ``samples``, by identity) that holds it, with that sample's index, else in ``obj``."""
    if worker_index() is None:
        return InProcess(obj)
    try:
        return pack(obj)
    except Exception as exc:  # noqa: BLE001 - pickling user objects raises anything: the value is named below
        raise _unsendable(obj, samples, exc) from None


def _refuses_pickle(value: Any) -> bool:
    try:
        pack(value)
    except Exception:  # noqa: BLE001 - a user value's pickling can raise anything: that is the answer
        return True
    return False


def _unsendable(obj: Any, samples: Sequence[Keyed], exc: Exception) -> CollateError:
    found = find_value(obj, _refuses_pickle)
    if found is None:  # (only the whole object fails to pickle)
        return unsendable_error("the batch", None, exc, *_FIX_IN)
    path, value = found
    for keyed in samples:
        inside = find_value(keyed.sample, lambda v: v is value)
        if inside is not None:
            where = f"{describe_path(inside[0])} of index {keyed.index}"
            return unsendable_error(where, value, exc, *_FIX_IN)
    where = describe_path(path, "batch") if path else "the batch"
    if samples:
        where += f" (of {summarize_indices([k.index for k in samples])})"
    return unsendable_error(where, value, exc, *_FIX_IN)


def unpack(packed: Packed | InProcess) -> Any:
    """The object back, its tensors and arrays views of the delivered arrays (no copy)."""
    if type(packed) is InProcess:
        return packed.value
    return _RefUnpickler(io.BytesIO(packed.skeleton), packed.arrays).load()


def unpack_convert(packed: Packed) -> Any:
    """``unpack``, then torch's ``default_convert`` (``batch_size=None`` without a ``collate_fn``)."""
    return _tud.default_convert(unpack(packed))


class Keyed(NamedTuple):
    """A sample for a custom ``collate_fn``, with its index (``TorchSource``): a value that
    cannot be sent is named by the index of the sample holding it."""

    index: Any
    sample: Any


class PackingCollate:
    """The user's collate_fn, run in the worker on the samples (``Keyed``); its result leaves as a ``Packed``."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Keyed]) -> Packed | InProcess:
        return pack_for_consumer(self.collate_fn([keyed.sample for keyed in samples]), samples)
