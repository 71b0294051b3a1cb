"""PyTorch adapter: a drop-in ``DataLoader`` (needs ``torch``).

``import procpipe`` never imports this module; it is loaded by ``import procpipe.torch``.

- ``procpipe.torch.DataLoader``: ``torch.utils.data.DataLoader`` with procpipe's engine.
  Same arguments, same meaning, same batches in the same order; switch by changing one
  import. Tensors produced in the workers travel through the shared-memory ring (never
  pickled) and arrive as tensors sharing memory with it.
- ``device_stage`` and ``to_torch`` (what ``Loader(device=...)`` uses) live in
  ``procpipe.api.torch_device`` and are re-exported here.

Where it sits in the data path (coordinator -> worker -> ring slot -> reassembly ->
prefetch -> consumer): at both ends. Worker side: ``_TorchSource`` turns the dataset's
samples into numpy (tensors are viewed, not copied) so the core collates them straight
into the ring; a custom ``collate_fn``'s result is pickled *without* its tensors and numpy
arrays (pickle's persistent ids), which go through the ring instead. Consumer side: the
batches are rebuilt as zero-copy tensor views, whatever object holds them (dict,
dataclass, custom batch class...), and handed to ``procpipe.api.torch_device``'s stage thread
when ``device=``, ``pin_memory=True`` or ``timeout`` asks for one. An ``IterableDataset``
is read by one replica per worker, each a streaming source (``procpipe.torch_iterable``).
"""

from __future__ import annotations

import copy
import functools
import io
import operator
import os
import pickle
import random
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, NamedTuple, TypedDict, TypeVar, final

import numpy as np
import torch
import torch.utils.data as _tud

from .api.config import LoaderConfig
from .api.torch_device import CudaTransfer, Stage, device_stage, resolve_device, to_torch
from .api.validate import START_METHODS
from .core import classref
from .core.rng import mix_seed as _mix
from .core.rng import reseed_current_sample
from .core.tensors import DTYPE_NAMES as _DTYPE_NAMES
from .core.tensors import numpy_tensor as _numpy_tensor
from .core.tensors import tensor_numpy as _tensor_numpy
from .loader import Loader
from .torch_iterable import RaisedInReplica, Replicas, ReplicaSpec, in_process, reraise, sharding_init
from .torch_snapshots import ReplicaEnded
from .torch_state import FacadeState, none_sample_error, on_moved, on_value

__all__ = ["DataLoader", "device_stage", "to_torch"]

_MASK64 = (1 << 64) - 1
_UNKNOWN_LENGTH = 1 << 62  # a map-style dataset without __len__ (allowed with a custom sampler)

# --------------------------------------------------------------------------- tensors <-> numpy
# (procpipe.core.tensors, shared with the core's collation of tensor samples)


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
def _sample_to_wire(x: Any) -> Any:
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
        return {k: _sample_to_wire(v) for k, v in x.items()}
    if isinstance(x, Mapping):  # torch's default_collate keeps the class: carry it
        return _MappingOf(_Opaque(_empty_like(x)), {k: _sample_to_wire(v) for k, v in x.items()})
    if kind is tuple or kind is list:
        return kind([_sample_to_wire(v) for v in x])
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return kind(*(_sample_to_wire(v) for v in x))
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


def _from_default(x: Any, in_sequence: bool = False) -> Any:
    """A core batch of ``_sample_to_wire`` samples, as ``default_collate`` would have built it."""
    kind = type(x)
    if kind is np.ndarray:
        return torch.from_numpy(x)
    if kind is dict:
        return {k: _from_default(v) for k, v in x.items()}
    if kind is list or kind is tuple:  # torch turns a tuple of columns into a list
        return [_from_default(v, True) for v in x]
    if kind is _MappingOf:
        return _rebuild_mapping(x.template[0].value, _from_default(x.items))
    if kind is _Leaf:
        # default_collate sees a column as the tuple zip() makes (inside a sequence) or a list.
        values = x.value
        return _tud.default_collate(tuple(values) if in_sequence else list(values))
    dtype = _BITS_MARKERS.get(kind)
    if dtype is not None:
        return _numpy_tensor(x.bits, dtype)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return kind(*(_from_default(v, True) for v in x))
    return x


# ---- custom collate_fn / unbatched: pickle the object, its arrays through the ring ----
class _Packed(NamedTuple):
    skeleton: bytes  # the object pickled with each tensor/array replaced by a reference
    arrays: list[Any]  # those arrays, in the ring


class _RefPickler(classref.Pickler):
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


def _pack(obj: Any) -> _Packed:
    arrays: list[Any] = []
    buffer = io.BytesIO()
    try:
        _RefPickler(buffer, arrays).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError):

        class _DillRefPickler(classref.DillPickler):  # lambdas, local classes...
            def persistent_id(self, o: Any) -> Any:
                return _persistent_id(self, o)

        arrays, buffer = [], io.BytesIO()
        pickler = _DillRefPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.arrays, pickler.seen = arrays, {}
        pickler.dump(obj)
    return _Packed(buffer.getvalue(), arrays)


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


@final  # (so that `type(packed) is _InProcess` tells a type checker the other case is a _Packed)
class _InProcess:
    """A ``collate_fn`` result or unbatched sample made in this process (``num_workers=0``):
    handed over as is, so it is the very object (and class) torch's DataLoader would yield."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _pack_for_consumer(obj: Any) -> _Packed | _InProcess:
    return _InProcess(obj) if _worker_index() is None else _pack(obj)


def _unpack(packed: _Packed | _InProcess) -> Any:
    if type(packed) is _InProcess:
        return packed.value
    return _RefUnpickler(io.BytesIO(packed.skeleton), packed.arrays).load()


def _unpack_convert(packed: _Packed) -> Any:
    return _tud.default_convert(_unpack(packed))


class _PackingCollate:
    """The user's collate_fn, run in the worker; its result leaves as a ``_Packed``."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> _Packed | _InProcess:
        return _pack_for_consumer(self.collate_fn(samples))


# ---- the dataset, as the workers see it -----------------------------------------------
# BULK: batch_size=None with a sampler yielding lists of indices: dataset[list] per item.
DEFAULT, CUSTOM, UNBATCHED, BULK = "default", "custom", "unbatched", "bulk"


_WORKER_NAME = "procpipe-worker-"  # the coordinator names its processes procpipe-worker-<index>


def _worker_index() -> int | None:
    """This process's worker index, or None outside a procpipe worker."""
    import multiprocess

    name = multiprocess.current_process().name
    if not name.startswith(_WORKER_NAME):
        return None
    try:
        return int(name[len(_WORKER_NAME) :])
    except ValueError:
        return 0


class _TorchSource:
    """Wraps a map-style dataset for the core: worker set-up, per-sample seeding, conversion.

    In a worker, before each batch, the core seeds torch's, numpy's and Python's global
    generators from ``(seed, epoch, its first index)`` (``Loader(seed_globals=True)``, procpipe.core.rng),
    so augmentation drawn from them is the same whatever ``num_workers`` and however
    batches are scheduled (torch seeds per worker).
    """

    def __init__(
        self,
        dataset: Any,
        mode: str,
        item_fn: Callable[[Any], Any] | None,
        worker_init_fn: Callable[[int], Any] | None,
        num_workers: int,
        seed: int,
    ) -> None:
        self.dataset = dataset
        self.mode = mode
        self.item_fn = item_fn  # collate_fn applied to each sample (batch_size=None + collate_fn)
        self.worker_init_fn = worker_init_fn
        self.num_workers = num_workers
        self.seed = seed
        try:
            self.length = len(dataset)
        except TypeError:
            self.length = _UNKNOWN_LENGTH
        self._pid: int | None = None
        self._in_worker = False

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pid"] = None
        return state

    def _enter_process(self) -> None:
        self._pid = os.getpid()
        worker_id = _worker_index()
        self._in_worker = worker_id is not None
        if worker_id is None:
            return  # num_workers=0: like torch, the main process's generators are left alone
        torch.set_num_threads(1)
        seed = (self.seed + worker_id) & _MASK64
        random.seed(seed)
        torch.manual_seed(seed)
        np.random.seed(_mix(seed) & 0xFFFFFFFF)
        try:
            from torch.utils.data._utils import worker as _worker

            _worker._worker_info = _worker.WorkerInfo(
                id=worker_id, num_workers=self.num_workers, seed=seed, dataset=self.dataset
            )
        except Exception:  # noqa: BLE001, S110 - private torch API; get_worker_info() then returns None
            pass
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)

    def __getitem__(self, index: int) -> Any:
        if self._pid != os.getpid():
            self._enter_process()
            reseed_current_sample()  # the per-worker set-up above re-seeded the generators
        if self.mode == BULK:
            return index  # _BulkFetch loads the whole list at once
        sample = self.dataset[index]
        if self.mode == DEFAULT:
            if sample is None:
                raise none_sample_error(index)
            return _sample_to_wire(sample)
        if self.mode == UNBATCHED:
            return _pack_for_consumer(sample if self.item_fn is None else self.item_fn(sample))
        return sample  # CUSTOM: the collate_fn gets the samples as the dataset made them


class _BulkFetch:
    """``collate_fn`` for the core in ``BULK`` mode, run in the worker: ``dataset[indices]``
    (the sampler's item, a list) in one call, then the user's ``collate_fn``, if any."""

    def __init__(self, source: _TorchSource) -> None:
        self.source = source

    def __call__(self, indices: list[Any]) -> _Packed | _InProcess:
        source = self.source
        data = source.dataset[list(indices)]
        return _pack_for_consumer(data if source.item_fn is None else source.item_fn(data))


def _is_index(item: Any) -> bool:
    try:
        operator.index(item)
    except TypeError:
        return False
    return True


class _SamplerBatches:
    """``batches=`` for the core: one epoch of a torch (batch) sampler, materialized.

    Without auto-batching (``batch_size=None``) a sampler item is either one index or,
    as torch allows, a list of indices the dataset loads at once ("bulk loading"):
    ``plan()`` draws the epoch's items before the loader starts and says which.
    """

    def __init__(self, index_sampler: Any, unbatched: bool) -> None:
        self.index_sampler = index_sampler
        self.unbatched = unbatched
        self.bulk = False
        self._planned: list[Any] | None = None
        self.before_draw: Callable[[], None] | None = None  # the facade's state, told before each draw

    def _draw(self) -> list[Any]:
        if self.before_draw is not None:
            self.before_draw()
        return list(self.index_sampler)

    def __len__(self) -> int:
        return len(self.index_sampler)

    def plan(self) -> bool:
        """Draw the next epoch's items from the sampler now (the next call returns them);
        whether they are lists of indices (bulk loading)."""
        self._planned = items = self._draw()
        return bool(items) and not _is_index(items[0])

    def __call__(self, epoch: int) -> list[list[Any]]:
        items, self._planned = self._planned, None
        if items is None:
            items = self._draw()
        if not self.unbatched:
            return [list(batch) for batch in items]
        if not self.bulk:
            return [[index] for index in items]
        out = []
        for position, item in enumerate(items):
            if _is_index(item) or not all(_is_index(i) for i in item):
                raise TypeError(
                    f"the sampler yielded {item!r} (item {position}) after lists of indices: with "
                    "batch_size=None, procpipe.torch.DataLoader takes a sampler yielding integer indices, "
                    "or one yielding lists of integer indices (each list is passed to dataset[...] at once), "
                    "not a mix"
                )
            out.append(list(item))
        return out


# --------------------------------------------------------------------------- DataLoader facade
def _start_method(context: Any) -> str:
    if context is None:
        return "auto"
    method = context if isinstance(context, str) else context.get_start_method()
    if method not in START_METHODS:
        raise ValueError(f"multiprocessing_context={context!r}: procpipe supports the start methods {START_METHODS}")
    return method


_T_co = TypeVar("_T_co", covariant=True)


class _LoaderOptions(TypedDict):
    """The facade's keyword arguments for each ``procpipe.Loader`` it makes (a plain dict at run
    time; typed so that a checker matches each key to the ``Loader`` parameter of that name)."""

    batch_size: int | None
    workers: int
    ordered: bool
    prefetch: int
    seed: int
    collate_fn: Callable[[list[Any]], Any] | None
    start_method: str
    shm_dir: str
    slot_bytes: int | None
    max_worker_restarts: int
    worker_env: dict[str, str] | None
    batches: _SamplerBatches | None
    seed_globals: bool
    stage_slots: int


class DataLoader(_tud.DataLoader[_T_co]):  # type: ignore[misc]  # torch is typed as Any (pyproject's [tool.mypy])
    """``torch.utils.data.DataLoader``, loading with procpipe's engine.

    Accepts torch's arguments with torch's meaning and yields the same batches, in the
    same order (with ``in_order=False``, as they finish). torch validates the arguments
    and builds the samplers; each epoch the index sampler runs in this process and its
    batches go to procpipe's workers. Differences, all documented in the README section
    "PyTorch: procpipe.torch.DataLoader":

    - a map-style dataset's sampler must have a length and yield integer indices (with
      ``batch_size=None``, or lists of them: each list is loaded with one ``dataset[list]``
      call); ``__getitems__`` is not used (each index is fetched with ``__getitem__``, which
      is what it stands for);
    - an ``IterableDataset`` is iterated as torch does (a replica per worker, round-robin
      with ``in_order``; see ``procpipe.torch_iterable``), except that a worker that dies
      ends the epoch with ``ReplicaLostError`` (its iterator cannot be resumed elsewhere);
    - ``multiprocessing_context=None`` means procpipe's ``"auto"``: ``"fork"`` (torch's
      default) while the process runs no OS thread but its main one and those that ran when
      procpipe was imported (numpy's BLAS pool), else the fork-safe ``"forkserver"`` (a
      dataset holding ``multiprocessing`` locks or shared values then needs ``"fork"``);
      resolved for the first epoch and kept for later epochs' workers;
    - each batch goes to the least busy worker, not round-robin: ``get_worker_info().id``
      is the worker that really loads it;
    - in workers, torch's, numpy's and ``random``'s global generators are re-seeded
      before every sample from ``(seed, epoch, index)``, so augmentation does not depend
      on ``num_workers`` (``seed`` is the ``generator``'s, or torch's, initial seed);
    - ``prefetch_factor * num_workers`` ready batches are kept ahead (torch counts the same
      total; procpipe also keeps up to two tasks per worker in flight).

    ``state_dict()`` / ``load_state_dict()`` and ``snapshot_every_n_steps`` are torchdata's
    ``StatefulDataLoader``'s (``procpipe.torch_state``; docs/guide/pytorch-resume.md).

    Extra keyword arguments (procpipe's): ``device`` ("cuda[:N]": batches arrive already
    on the GPU, see ``Loader(device=...)``), ``slot_bytes``, ``shm_dir``,
    ``max_worker_restarts``, ``worker_env``. ``close()`` ends the workers now.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: Any = None,
        slot_bytes: int | None = None,
        shm_dir: str = "/dev/shm",
        max_worker_restarts: int = 3,
        worker_env: dict[str, str] | None = None,
        snapshot_every_n_steps: int | None = 1,
    ) -> None:
        self._pp_iterable = isinstance(dataset, _tud.IterableDataset)
        if not self._pp_iterable and not hasattr(dataset, "__getitem__"):
            raise TypeError(f"dataset must support indexing (__getitem__); got {type(dataset).__name__}")
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        try:
            if not self._pp_iterable:  # (an IterableDataset's sampler is torch's endless one)
                len(self._index_sampler)
        except TypeError:
            raise TypeError(
                "procpipe.torch.DataLoader needs a sampler with a length (each epoch's batches are planned "
                f"when it starts); {type(self._index_sampler).__name__} has no __len__"
            ) from None
        self._pp_start_method = _start_method(multiprocessing_context)
        self._pp_device = None if device is None else resolve_device(device)
        if self._pp_device is not None and self._pp_device.type == "cpu":
            self._pp_device = None  # batches are CPU tensors already
        self._pp_convert: Callable[[Any], Any]
        if self._pp_iterable:  # batches are collated and packed in the worker (procpipe.torch_iterable)
            mode, item_fn = CUSTOM, None
            self._pp_convert = _unpack
        elif not self._auto_collation:  # collate_fn (default: default_convert) applies to each sample
            default = self.collate_fn is _tud.default_convert
            mode, item_fn = UNBATCHED, (None if default else self.collate_fn)
            self._pp_convert = _unpack_convert if default else _unpack
        elif self.collate_fn is _tud.default_collate:
            mode, item_fn = DEFAULT, None
            self._pp_convert = _from_default
        else:
            mode, item_fn = CUSTOM, None
            self._pp_convert = _unpack
        self._pp_seed = int((generator if generator is not None else torch.default_generator).initial_seed())
        self._pp_source = (
            None
            if self._pp_iterable
            else _TorchSource(dataset, mode, item_fn, worker_init_fn, num_workers, self._pp_seed)
        )
        batches = None if self._pp_iterable else _SamplerBatches(self._index_sampler, mode == UNBATCHED)
        self._pp_options = _LoaderOptions(
            batch_size=None if mode == UNBATCHED or self._pp_iterable else 1,  # sizes: the batch sampler's
            workers=num_workers,
            ordered=bool(in_order),
            prefetch=max(1, (self.prefetch_factor or 0) * num_workers),
            seed=self._pp_seed,
            collate_fn=_PackingCollate(self.collate_fn) if mode == CUSTOM and not self._pp_iterable else None,
            start_method=self._pp_start_method,
            shm_dir=shm_dir,
            slot_bytes=slot_bytes,
            max_worker_restarts=max_worker_restarts,
            worker_env=worker_env,
            batches=batches,
            seed_globals=num_workers > 0,  # like torch, num_workers=0 leaves the generators alone
            # the CUDA transfer's copies read batches in their slots: the ring gets slots for them
            stage_slots=0 if self._pp_device is None else CudaTransfer.SLOTS_HELD,
        )
        LoaderConfig.from_arguments(**self._pp_options)  # procpipe's arguments checked now, as torch checks its own
        self._pp_bulk_collate = None if self._pp_source is None else _BulkFetch(self._pp_source)
        self._pp_loader: Loader | None = None
        self._pp_current: Loader | None = None  # the loader of the latest iteration (stats())
        self._pp_epoch_loader: weakref.ref[Loader] | None = None  # the running epoch's (persistent_workers=False)
        self._pp_iterated = False
        self._pp_epochs = 0
        self._pp_transfer: CudaTransfer | None = None
        self._pp_state = FacadeState(
            dataset=dataset,
            iterable=self._pp_iterable,
            num_workers=num_workers,
            persistent=persistent_workers,
            generator=generator,
            snapshot_every=FacadeState.check_every(snapshot_every_n_steps or 0),
            shm_dir=shm_dir,
            index_sampler=None if self._pp_iterable else self._index_sampler,
        )
        weakref.finalize(self, FacadeState.cleanup, self._pp_state.stores)
        if batches is not None:
            # (the keeper and the sampler, not self: a cycle would keep the workers until the next gc)
            batches.before_draw = functools.partial(self._pp_state.before_draw, self._index_sampler)

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> _DataLoaderIter:
        reuse = self.persistent_workers and self.num_workers > 0 and self._pp_iterated
        pin = False
        base_seed = 0
        shared_seed: int | None = None  # an IterDataPipe's (torch draws one per iterator)
        datapipe = self._pp_iterable and isinstance(self.dataset, _tud.IterDataPipe)
        if not reuse:
            # What torch's iterator does when it is created: the same warnings, and the same
            # draw from the generator (so shuffling stays in step with torch's DataLoader).
            if self.pin_memory and self.pin_memory_device:
                warnings.warn(
                    "pin_memory_device is deprecated, the current accelerator will be used as the "
                    f"device,ignore pin_memory_device='{self.pin_memory_device}'.",
                    stacklevel=2,
                )
            if self.pin_memory and not torch.accelerator.is_available():
                warnings.warn(
                    "'pin_memory' argument is set as true but no accelerator is found, then device "
                    "pinned memory won't be used.",
                    stacklevel=2,
                )
            if datapipe:  # torch: a shared seed for the datapipe's random pipes, then the workers' base seed
                shared_seed = _draw_seed(self.generator)
            base_seed = _draw_seed(self.generator)
            if datapipe and self.num_workers > 0:
                _draw_seed(self.generator)  # torch's first _reset draws a shared seed its workers never see
        elif datapipe:
            _draw_seed(self.generator)  # torch's shared seed of this epoch (the replicas derive theirs)
        self._pp_iterated = True
        base_seed, shared_seed = self._pp_state.begin(self._pp_epochs, base_seed, shared_seed)
        if self.pin_memory and torch.accelerator.is_available():
            accelerator = torch.accelerator.current_accelerator()
            pin = accelerator is not None and accelerator.type != "mps"
        convert = self._pp_convert
        owned = None
        if self._pp_iterable and self.num_workers == 0:  # as torch: iterated here (errors in __iter__ raise now)
            dataset = in_process(self.dataset, shared_seed)
            epoch: Iterator[Any] = self._pp_state.in_process(
                dataset, self.batch_size if self._auto_collation else None, self.drop_last, self.collate_fn
            )
            convert = _same
            loader = None
        else:
            if self._pp_source is not None and self._pp_source.mode in (UNBATCHED, BULK):  # (map-style)
                self._pp_plan_unbatched()
            if self.persistent_workers or self.num_workers == 0:
                if self._pp_loader is None:
                    self._pp_loader = self._pp_new_loader(base_seed, shared_seed)
                loader = self._pp_loader
            else:  # like torch: fresh workers (and a fresh copy of the dataset) every epoch
                loader = owned = self._pp_new_loader(base_seed, shared_seed)
                self._pp_epoch_loader = weakref.ref(owned)
            loader.set_epoch(self._pp_epochs)
            self._pp_state.resume_loader(loader, None)
            self._pp_current = loader
            self._pp_epochs += 1
            epoch = iter(loader)
        stage: Stage | None = None  # a stage keeps its source's state with each batch (state_dict)
        keep = loader is not None
        depth = self._pp_options["prefetch"]
        if self._pp_device is not None:
            if self._pp_transfer is None:
                self._pp_transfer = CudaTransfer(self._pp_device, capacity=depth + 2)
            transfer = self._pp_transfer
            move = on_moved(transfer, convert)
            stage = Stage(
                epoch,
                lambda b: move(b, getattr(epoch, "position", None)),
                depth,
                self.timeout if self.num_workers else None,
                keep_state=keep,
            )
        elif pin:
            from torch.utils.data._utils.pin_memory import pin_memory as _pin

            pin_value = on_value(_pin)
            stage = Stage(
                epoch,
                lambda b: (pin_value(convert(b)), None),
                depth,
                self.timeout if self.num_workers else None,
                keep_state=keep,
            )
        elif self.timeout > 0 and self.num_workers > 0:  # torch ignores timeout without workers
            stage = Stage(epoch, lambda b: (convert(b), None), 0, self.timeout, keep_state=keep)
        self._pp_state.set_stage(stage)
        self._pp_state.started_iteration()
        if self._pp_iterable:  # torch: no len() for its iterator; it warns past the len() the dataset gave
            return _DataLoaderIter(
                epoch,
                convert,
                stage,
                owned,
                None,
                loader,
                self._IterableDataset_len_called,
                self.dataset,
                self.num_workers > 0,
                self._pp_state,
            )
        return _DataLoaderIter(epoch, convert, stage, owned, len(self), loader, state=self._pp_state)

    def _pp_plan_unbatched(self) -> None:
        """``batch_size=None``: draw the epoch's sampler items, and load each as one index or,
        for lists of indices, as one ``dataset[list]`` call (a loader's workers do one or the other)."""
        batches, source = self._pp_options["batches"], self._pp_source
        assert batches is not None and source is not None  # (map-style: __iter__ calls this for those only)
        bulk = batches.plan()
        if bulk == (source.mode == BULK):
            return
        if self._pp_loader is not None:
            raise TypeError(
                "the sampler switched between yielding indices and lists of indices; the workers of a "
                "persistent procpipe.torch.DataLoader load one kind: create a new DataLoader"
            )
        batches.bulk = bulk
        source.mode = BULK if bulk else UNBATCHED
        self._pp_options["batch_size"] = 1 if bulk else None
        self._pp_options["collate_fn"] = self._pp_bulk_collate if bulk else None

    def _pp_new_loader(self, base_seed: int, shared_seed: int | None) -> Loader:
        """The engine: over the dataset, or (IterableDataset) over one replica per worker
        (``shared_seed``: an IterDataPipe's, see ``procpipe.torch_iterable``)."""
        source: _TorchSource | Replicas | None = self._pp_source
        if self._pp_iterable:
            init = self.worker_init_fn if shared_seed is None else sharding_init(self.worker_init_fn)
            source = Replicas(
                ReplicaSpec(
                    self.dataset,
                    self.num_workers,
                    base_seed,
                    init,
                    self.batch_size if self._auto_collation else None,
                    self.drop_last,
                    self.collate_fn,
                    _pack,
                    shared_seed,
                    self._pp_epochs,
                    **self._pp_state.replica_options(self._pp_epochs),
                )
            )
            # torch's seeds per worker, then the replica's own draws: no per-record reseeding
            options = self._pp_options.copy()
            options["seed_globals"] = False
            loader = Loader(source, **options)
        else:
            loader = Loader(source, **self._pp_options)
        # "auto" is resolved once, for the first epoch: later epochs' workers (persistent_workers=False)
        # start the same way, though the training loop runs threads by then (torch forks each epoch too)
        self._pp_options["start_method"] = loader.start_method
        return loader

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration stands, as torchdata's ``StatefulDataLoader.state_dict()``: loaded into
        a DataLoader built the same way, the next ``iter()`` goes on with the next batch (docs:
        docs/guide/pytorch-resume.md; the logic: ``procpipe.torch_state``)."""
        return self._pp_state.state_dict(self._pp_seed)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` at the next ``iter()`` (the persistent workers, if any, are
        replaced, as torchdata's are); ``ValueError`` for a state of another kind of DataLoader."""
        self._pp_epochs = self._pp_state.load(state_dict)
        seed = state_dict["procpipe"].get("seed", self._pp_seed)
        if self._pp_loader is not None:
            self._pp_loader.close()
            self._pp_loader = None
        # the next iter() draws as the saved one's successor would (persistent workers: no new seeds)
        self._pp_iterated = bool(state_dict["procpipe"].get("finished")) and self.persistent_workers
        if seed != self._pp_seed:  # the per-sample seeds are the saved loader's
            self._pp_seed = self._pp_options["seed"] = seed
            if self._pp_source is not None:
                self._pp_source.seed = seed

    def stats(self) -> dict[str, Any]:
        """``procpipe.Loader.stats()`` of the engine behind the latest iteration (what
        ``python -m procpipe.bench`` reads); ``RuntimeError`` before the first one."""
        if self._pp_current is None:
            raise RuntimeError("stats() describes an iteration: iterate over the DataLoader first")
        return self._pp_current.stats()

    def close(self) -> None:
        """End the workers and remove the shared memory now (otherwise done when collected),
        those of an epoch still being iterated included."""
        # The CUDA transfer first (as Loader.close): its registrations of the rings end
        # before the rings are unmapped. A later iteration makes a new one (direct copies).
        transfer, self._pp_transfer = self._pp_transfer, None
        if transfer is not None:
            transfer.close()
        self._pp_state.close()
        epoch_loader = self._pp_epoch_loader() if self._pp_epoch_loader is not None else None
        if epoch_loader is not None:
            epoch_loader.close()
        if self._pp_loader is not None:
            self._pp_loader.close()
            self._pp_loader = None

    @property
    def start_method(self) -> str:
        """How the workers start: ``"fork"``, ``"forkserver"`` or ``"spawn"`` once the first
        iteration has created the engine (``"auto"`` is resolved then, and kept for every later
        epoch: ``procpipe.Loader.start_method``); until then, the method asked for."""
        return self._pp_options["start_method"]

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the persistent workers (empty before the first epoch or without them)."""
        return [] if self._pp_loader is None else self._pp_loader.worker_pids


def _same(batch: Any) -> Any:
    return batch


def _draw_seed(generator: torch.Generator | None) -> int:
    """A seed drawn from the loader's generator as torch's iterator draws its seeds."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


class _DataLoaderIter:
    """One epoch of a ``procpipe.torch.DataLoader``."""

    def __init__(
        self,
        epoch: Iterator[Any],
        convert: Callable[[Any], Any],
        stage: Stage | None,
        owned: Loader | None,
        length: int | None,
        loader: Loader | None,
        len_called: int | None = None,
        dataset: Any = None,
        with_workers: bool = False,
        state: FacadeState | None = None,
    ) -> None:
        self._epoch = epoch
        self._convert = convert
        self._stage = stage
        self._owned = owned  # a per-epoch Loader (persistent_workers=False), closed at the end
        self._length = length  # None: an IterableDataset's (no len(), as torch's)
        self._len_called = len_called  # an IterableDataset's len() if len(loader) was asked: warn past it
        self._dataset = dataset
        self._with_workers = with_workers
        self._yielded = 0
        self._loader = loader  # None: an IterableDataset iterated in this process
        self._state = state  # the DataLoader's state_dict keeper: told what is returned

    @property
    def _workers(self) -> list[Any]:
        """The worker processes (``multiprocess.Process``), as torch's iterator's ``_workers``
        (code that reaches into it: ``pid``, ``is_alive()``, ``join()``). Empty once closed."""
        return [] if self._loader is None else self._loader.worker_processes

    def __iter__(self) -> _DataLoaderIter:
        return self

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(
                "an iterator over an IterableDataset has no len() (as torch's); len(loader) "
                "gives the length the dataset reports"
            )
        return self._length

    def __next__(self) -> Any:
        while True:
            try:
                batch = next(self._stage) if self._stage is not None else self._convert(next(self._epoch))
            except StopIteration:
                self._finish()
                if self._state is not None:
                    self._state.finished()
                raise
            if self._state is None or type(batch := self._state.received(batch)) is not ReplicaEnded:
                break
        if self._length is None:
            if type(batch) is RaisedInReplica:  # an error in a replica, in the place of its batch
                reraise(batch)
            self._counted()
        return batch

    def _counted(self) -> None:
        """torch's check (and message, which code may filter on): more batches than the dataset's len()."""
        self._yielded += 1
        if self._len_called is not None and self._yielded > self._len_called:
            message = (
                f"Length of IterableDataset {self._dataset} was reported to be {self._len_called}"
                f"(when accessing len(dataloader)), but {self._yielded} samples have been fetched. "
            )
            if self._with_workers:
                message += (
                    "For multiprocessing data-loading, this could be caused by not properly configuring "
                    "the IterableDataset replica at each worker (shard it in __iter__ with "
                    "torch.utils.data.get_worker_info())."
                )
            warnings.warn(message, stacklevel=3)

    def _finish(self) -> None:
        if self._state is not None:
            self._state.closing()  # (before the stage or the loader closes)
        if self._stage is not None:
            self._stage.close()
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def __del__(self) -> None:
        try:
            self._finish()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass
