"""TensorFlow adapter: a procpipe loader as a ``tf.data.Dataset``.

```python
import procpipe, procpipe.tf

loader = procpipe.Loader(records, preprocess, batch_size=64, workers=4, shuffle=True)
ds = procpipe.tf.dataset(loader).prefetch(2)      # element_spec exact, from the loader's batches
model.fit(ds, epochs=10)                          # each pass over ds is one epoch of the loader
```

What it guarantees, and why:

- **The element_spec is exact.** Dicts, tuples and namedtuples keep their structure (a list
  of arrays becomes a tuple, as ``tf.data`` has no list structure); a batch's list of
  ``str``/``bytes`` (what the default collation makes of a ``str`` field) is a ``tf.string``
  vector, numpy ``U``/``S`` arrays too; every other dimension is known, so no
  ``_fixup_shape`` map is needed. The batch dimension is fixed (``batch_size``) when
  ``drop_last=True`` makes every batch full, else ``None``. The spec is inferred from the
  first batch of the loader's next iteration, which is then put back (``state_dict()``
  before it, ``load_state_dict()`` after): the first pass still starts at that
  iteration's first batch, in its order (:func:`element_spec`). Pass ``element_spec=``
  to skip that look (it costs one cancelled start of an epoch in the workers), and
  where dimensions vary between batches (padding to the longest sample, ``batches=`` of
  varying sizes): :func:`spec_of` builds one from a batch.
- **One pass = one iteration of the loader** (one epoch, or ``epochs=N`` of them), exactly
  once: a pass calls ``iter(loader)`` when its first element is asked for (never
  before), so a ``tf.data`` iterator that is created and dropped unused costs nothing.
  A loader runs one iteration at a time, so a second iterator over the same dataset that
  starts while another is mid-pass (``tf.data.Dataset.zip((ds, ds))``, two live
  ``iter(ds)``) raises an error saying so instead of ending the first one's epoch.
  Dropping an iterator ends its pass at once (TensorFlow finalizes the generator).
- **Copies no more than it must.** A batch's arrays are zero-copy views of the loader's
  shared-memory ring, and TensorFlow adopts such an (aligned) array without copying it, so a
  tensor keeps its batch's ring slot until it is dropped; once the workers find no free
  slot they fall back to the slower inline path. So TensorFlow gets views of at most
  ``views`` batches at once (default ``VIEWS = 4``: the batch in use, the one being made, and
  two that TensorFlow has dropped but not yet let go of: it defers releasing the arrays it
  adopted, see ``VIEWS``), and
  past that each array that is a view is copied once, into a fresh 64-byte-aligned
  buffer that TensorFlow adopts as is (one copy, not two: numpy's own allocations are
  only 16-byte aligned, which TensorFlow copies again), the batch being dropped before it
  is handed over so that its slot is free at once. Arrays the batch owns (``workers=0``,
  the inline path) are never copied. The loader keeps ``views`` ring slots spare for them
  (``Loader.reserve_stage_slots``, called by :func:`dataset`), so the slots TensorFlow
  holds are not taken from the workers' share; ``stage_slots=`` is for stages of your own.
- **No wait at the end of a pass.** ``tf.data``'s autotuning is off for the pipeline
  (``dataset(..., autotune=True)`` leaves it on): with it, dropping a TensorFlow iterator
  at the end of a pass waits for the autotuning thread's timer, in some passes up to
  about as long as the pass took, while the workers sit idle. The loader's workers and
  prefetch do the tuning that matters here.
- **Composable**: the result is a plain ``tf.data.Dataset`` (``map``, ``prefetch``,
  ``zip`` with another, ``strategy.experimental_distribute_dataset``).
- **Cleans up with the loader**: the dataset holds the loader, not its workers or files;
  ``loader.close()`` ends them, after which a pass raises the loader's "closed" error.

``import procpipe`` never imports this module (nor TensorFlow).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeAlias

import numpy as np
import tensorflow as tf

__all__ = ["ALIGN", "VIEWS", "dataset", "element_spec", "spec_of"]

ALIGN = 64  # bytes: TensorFlow adopts a numpy buffer aligned to this without copying it
#: Batches TensorFlow may hold as ring views at once, by default. Not 2 (the batch in use and the
#: one being made): TensorFlow releases an adopted numpy array later than the tensor is dropped (it
#: queues the release until it next holds the GIL), so when the next batch is made, the batches
#: it still holds are often 2, at times 3 or 4. Measured with a loop that keeps its batch while the
#: next one comes (``for b in ds: step(b)``), 224x224x3 batches: 2 views copied 43 of 100 batches,
#: 4 copied 4.
VIEWS = 4

#: ``element_spec=``: a nest (dict, tuple, namedtuple) of ``tf.TypeSpec`` (``tf.TensorSpec`` leaves).
ElementSpec: TypeAlias = Any

_STRING_KINDS = ("U", "S")
_NUMBER_TYPES = (bool, int, float, complex, np.generic)


def dataset(
    loader: Any, *, element_spec: ElementSpec = None, views: int = VIEWS, autotune: bool = False
) -> tf.data.Dataset:
    """``loader`` as a ``tf.data.Dataset``: each pass over it is one ``iter(loader)``.

    Args:
        loader: a ``procpipe.Loader``; with ``element_spec`` given, any object whose
            ``iter()`` starts one pass over batches (``procpipe.torch.DataLoader`` too).
        element_spec: the structure of ``tf.TensorSpec`` of a batch; by default inferred
            from the loader's next batch without consuming it (:func:`element_spec`).
        views: how many batches TensorFlow may hold at once as zero-copy views of the
            loader's ring (each holds a ring slot until its tensors are dropped); past it,
            each array that is a view is copied once into memory TensorFlow owns. ``0``:
            always copy. The loader keeps as many ring slots spare for them
            (``Loader.reserve_stage_slots(views)``, called here), so the slots TensorFlow holds
            are not taken from the workers' share; a pipeline that keeps ``k`` more batches
            (``prefetch(k)``) stays zero-copy with ``views=k + VIEWS``.
        autotune: leave ``tf.data``'s autotuning on for the pipeline built on this dataset.
            Off by default (``tf.data.Options().autotune.enabled = False``): the loader's
            workers and prefetch already do what it tunes, and with it on, TensorFlow's
            iterator, when it is dropped at the end of a pass, waits for its autotuning
            thread's timer (in some passes and not others, up to about as long as the pass
            took: measured 2 s after 3-second passes, 10 s after a 10-second one). Downstream
            ``map(num_parallel_calls=AUTOTUNE)`` then runs as many calls as there are cores
            and ``prefetch(AUTOTUNE)`` keeps its own buffer tuning. A later
            ``.with_options()`` that turns autotuning on overrides this.

    Returns:
        A ``tf.data.Dataset`` whose ``element_spec`` is that structure. Its cardinality is
        unknown (a resumed loader's first pass is shorter than ``len(loader)``).

    Raises:
        TypeError: ``element_spec`` is not a structure of ``tf.TensorSpec``, or it is left
            out for an object that cannot be looked at without consuming it; ``autotune`` is
            not a bool.
        ValueError: ``views`` is not an int >= 0, or the first batch holds something
            TensorFlow has no tensor type for.
    """
    if not isinstance(views, int) or isinstance(views, bool) or views < 0:
        raise ValueError(f"procpipe.tf.dataset: views must be an int >= 0, got {views!r}")
    if not isinstance(autotune, bool):
        raise TypeError(f"procpipe.tf.dataset: autotune must be True or False, got {autotune!r}")
    reserve = getattr(loader, "reserve_stage_slots", None)
    if views and callable(reserve):  # before the spec's look: the ring is then made with them
        reserve(views)
    spec = _infer(loader) if element_spec is None else element_spec
    plan = _compile(spec, ())
    passes = _DatasetPasses(loader, plan, views)
    result = tf.data.Dataset.from_generator(passes, output_signature=spec)
    if autotune:
        return result
    options = tf.data.Options()
    options.autotune.enabled = False
    return result.with_options(options)


def element_spec(loader: Any, *, map_batch: Callable[[Any], Any] | None = None) -> Any:
    """The ``element_spec`` of ``loader``'s batches, from the first batch of its next iteration.

    The batch is looked at, then put back: ``it = iter(loader)`` (what the next pass would
    do first), ``state = loader.state_dict()``, ``next(it)``, ``loader.load_state_dict(state)``,
    so the next ``iter(loader)`` starts from that same first batch, in the same order
    (``loader.epoch`` is unchanged). This uses the loader's own machinery (``fn``,
    ``collate_fn``, ``batch_fn``, ``device``: the spec is that of what a pass yields); its
    cost is one cancelled start of an epoch (the workers' batches in flight are dropped).
    ``map_batch`` (optional) is applied to the batch first (``procpipe.keras`` uses it).

    Raises:
        TypeError: ``loader`` has no ``state_dict``/``load_state_dict``; pass
            ``element_spec=`` to :func:`dataset` instead.
        ValueError: the next iteration has no batch, or a batch holds something TensorFlow
            has no tensor type for (the message names the field).
    """
    if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
        raise TypeError(
            f"procpipe.tf: cannot infer the element_spec of a {type(loader).__name__}: it is read from the first "
            "batch of a procpipe.Loader, which is then put back with state_dict()/load_state_dict(). Pass "
            "element_spec=... (procpipe.tf.spec_of(batch) builds one from a batch you have)."
        )
    it = iter(loader)
    start = loader.state_dict()
    try:
        first = next(it)
    except StopIteration:
        raise ValueError(
            "procpipe.tf: the loader's next iteration yields no batch, so there is no element_spec to "
            "infer; pass element_spec=..."
        ) from None
    finally:
        del it
        loader.load_state_dict(start)
    if map_batch is not None:
        first = map_batch(first)
    batch_size = start.get("batch_size")
    return spec_of(first, batched=batch_size is not None, batch_size=batch_size if start.get("drop_last") else None)


_infer = element_spec  # dataset()'s argument of the same name hides the function there


def spec_of(batch: Any, *, batched: bool = True, batch_size: int | None = None) -> Any:
    """The ``tf.TensorSpec`` structure of ``batch`` (a batch as a procpipe loader yields it).

    Args:
        batch: dicts, tuples, namedtuples and lists of numpy arrays, numbers, torch tensors,
            ``str``/``bytes`` and lists of those (a list of ``str``/``bytes`` is a
            ``tf.string`` vector; a list of arrays or containers is a tuple).
        batched: the first dimension of every leaf that has one is the batch dimension,
            set to ``batch_size``; ``False`` keeps every dimension as it is (unbatched
            samples, ``Loader(batch_size=None)``).
        batch_size: the batch dimension when every batch has it (``drop_last=True``);
            ``None``: unknown (the last batch may be smaller).

    Raises:
        ValueError: a leaf TensorFlow has no tensor type for (``None``, objects, object or
            structured arrays); the message names it.
    """
    return _spec(batch, (), batch_size if batched else False)


# ------------------------------------------------------------------------------ inferring the spec
def _where(path: tuple) -> str:
    return "batch" + "".join(f"[{p!r}]" for p in path)


def _leading(shape: tuple, batch: int | bool | None) -> tuple:
    """``shape`` with its first dimension made the batch dimension (``batch=False``: unbatched)."""
    if batch is False or not shape:
        return tuple(shape)
    first = batch if batch is not None and shape[0] == batch else None
    return (first, *shape[1:])


def _numpy(value: Any) -> Any:
    """A torch tensor's values as numpy (sharing memory on the CPU); anything else as it is."""
    if not isinstance(value, np.ndarray) and hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu().numpy()
    return value


def _unsupported(value: Any, path: tuple, why: str = "") -> ValueError:
    what = f"an array of dtype {value.dtype}" if isinstance(value, np.ndarray) else f"a {type(value).__name__}"
    return ValueError(
        f"procpipe.tf: {_where(path)} is {what}{why}, which has no TensorFlow tensor type. Make it numbers, "
        "str or bytes in the loader's fn or collate_fn (or leave it out of the batch)."
    )


def _spec(value: Any, path: tuple, batch: int | bool | None) -> Any:
    value = _numpy(value)
    if isinstance(value, Mapping):
        return {k: _spec(v, path + (k,), batch) for k, v in value.items()}
    if isinstance(value, tuple):
        specs = [_spec(v, path + (i,), batch) for i, v in enumerate(value)]
        return type(value)(*specs) if hasattr(value, "_fields") else tuple(specs)
    if isinstance(value, list):
        if value and all(isinstance(v, (str, bytes)) for v in value):
            return tf.TensorSpec(_leading((len(value),), batch), tf.string)
        if value and all(isinstance(v, _NUMBER_TYPES) for v in value):
            return _spec(np.asarray(value), path, batch)
        if value and all(isinstance(v, (np.ndarray, Mapping, tuple, list)) for v in value):
            return tuple(_spec(v, path + (i,), batch) for i, v in enumerate(value))
        raise _unsupported(
            value,
            path,
            " of " + ", ".join(sorted({type(v).__name__ for v in value}))
            if value
            else " (empty: its element type is unknown)",
        )
    if isinstance(value, (str, bytes)):
        return tf.TensorSpec((), tf.string)
    if isinstance(value, _NUMBER_TYPES):
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind in _STRING_KINDS:
            return tf.TensorSpec(_leading(value.shape, batch), tf.string)
        try:
            dtype = tf.as_dtype(value.dtype)
        except TypeError:
            raise _unsupported(value, path) from None
        return tf.TensorSpec(_leading(value.shape, batch), dtype)
    raise _unsupported(value, path)


# ------------------------------------------------------------------------------ converting batches
class _ElementLeaf:
    """One ``tf.TensorSpec`` of the element_spec, compiled for the per-batch check."""

    __slots__ = ("dims", "dtype", "path", "string")

    def __init__(self, path: tuple, spec: tf.TensorSpec) -> None:
        self.path = path
        self.dims = None if spec.shape.rank is None else tuple(spec.shape.as_list())
        self.string = spec.dtype == tf.string
        self.dtype = None if self.string else np.dtype(spec.dtype.as_numpy_dtype)


class _Node:
    """A dict (``keys``) or a tuple / namedtuple (``kind``) of the element_spec."""

    __slots__ = ("children", "keys", "kind", "path")

    def __init__(self, path: tuple, keys: tuple | None, kind: Any, children: list) -> None:
        self.path = path
        self.keys = keys
        self.kind = kind
        self.children = children


def _compile(spec: ElementSpec, path: tuple) -> Any:
    if isinstance(spec, tf.TensorSpec):
        return _ElementLeaf(path, spec)
    if isinstance(spec, Mapping):
        keys = tuple(spec.keys())
        return _Node(path, keys, dict, [_compile(spec[k], path + (k,)) for k in keys])
    if isinstance(spec, tuple):
        kind = type(spec) if hasattr(spec, "_fields") else tuple
        return _Node(path, None, kind, [_compile(s, path + (i,)) for i, s in enumerate(spec)])
    raise TypeError(
        f"procpipe.tf: element_spec{''.join(f'[{p!r}]' for p in path)} is a {type(spec).__name__}; "
        "an element_spec is a dict, tuple or namedtuple of tf.TensorSpec (procpipe.tf.spec_of(batch) "
        "builds one)"
    )


def _mismatch(path: tuple, got: str, want: str, dtype: bool = False) -> ValueError:
    """A batch that does not match the element_spec; ``dtype``: the mismatch is a leaf's dtype, whose
    fix is a cast (a spec has no "any dtype", as it has None for a dimension that varies)."""
    fix = (
        "Give every batch one dtype: cast in fn (or collate_fn / batch_fn), e.g. np.asarray(x, np.float32), "
        "or pass element_spec=... with the dtype the batches have."
        if dtype
        else "With batches that differ in structure or in a dimension other than the batch dimension (padding to "
        "the longest sample, batches= of varying sizes, on_error='skip' with drop_last=True), pass "
        "element_spec=... with None for the dimensions that vary."
    )
    return ValueError(
        f"procpipe.tf: {_where(path)} is {got}, but the dataset's element_spec says {want}. The spec comes from "
        f"the first batch (or element_spec=). {fix}"
    )


def _copy(array: np.ndarray) -> np.ndarray:
    """``array`` copied once into a fresh buffer aligned to ``ALIGN`` bytes, which TensorFlow adopts as is."""
    raw = np.empty(array.nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    out = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    np.copyto(out, array, casting="no")
    return out


class _HeldBatch:
    """What converting one batch needs: whether its views may be handed over, and those that were."""

    __slots__ = ("share", "views")

    def __init__(self, share: bool) -> None:
        self.share = share
        self.views: list[np.ndarray] = []

    def owned(self, array: np.ndarray) -> np.ndarray:
        """``array`` as TensorFlow gets it: as is if it owns its memory, or if views may be shared;
        else (a view of a ring slot, or of memory its owner may reuse) copied once."""
        if array.base is None:
            return array
        if self.share:
            self.views.append(array)
            return array
        return _copy(array)


class _Held:
    """How many batches TensorFlow holds as zero-copy views of the ring (each holds its slot).

    A batch counts from the moment its views are handed over until the last of them is
    garbage (TensorFlow dropped every tensor made from them).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._count = 0
        self._lock = threading.Lock()

    def room(self) -> bool:
        return self._count < self.limit

    def hold(self, views: list[np.ndarray]) -> None:
        left = [len(views)]
        with self._lock:
            self._count += 1

        def gone() -> None:
            with self._lock:
                left[0] -= 1
                if not left[0]:
                    self._count -= 1

        for view in views:
            weakref.finalize(view, gone)


def _convert(node: Any, value: Any, batch: _HeldBatch) -> Any:
    """``value`` checked against the compiled spec ``node``, its arrays as ``batch.owned`` gives them."""
    if type(node) is _ElementLeaf:
        return _leaf(node, value, batch)
    if node.keys is not None:
        if not isinstance(value, Mapping) or len(value) != len(node.keys) or any(k not in value for k in node.keys):
            got = (
                f"a mapping with keys {sorted(map(str, value))}"
                if isinstance(value, Mapping)
                else f"a {type(value).__name__}"
            )
            raise _mismatch(node.path, got, f"a dict with keys {sorted(map(str, node.keys))}")
        return {k: _convert(child, value[k], batch) for k, child in zip(node.keys, node.children, strict=True)}
    if not isinstance(value, (tuple, list)) or len(value) != len(node.children):
        got = f"a {type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (tuple, list)) else "")
        raise _mismatch(node.path, got, f"a {node.kind.__name__} of {len(node.children)}")
    items = [_convert(child, v, batch) for child, v in zip(node.children, value, strict=True)]
    return tuple(items) if node.kind is tuple else node.kind(*items)


def _leaf(leaf: _ElementLeaf, value: Any, batch: _HeldBatch) -> Any:
    value = _numpy(value)
    if leaf.string:
        if isinstance(value, list):
            shape: tuple = (len(value),)
        elif isinstance(value, (str, bytes)):
            shape = ()
        elif isinstance(value, np.ndarray) and value.dtype.kind in _STRING_KINDS + ("O",):
            shape = value.shape
        else:
            raise _mismatch(leaf.path, f"a {type(value).__name__}", "strings")
        _check_shape(leaf, shape)
        return value  # TensorFlow encodes str as UTF-8: a copy it must make anyway
    if not isinstance(value, np.ndarray):
        if not isinstance(value, _NUMBER_TYPES):
            raise _mismatch(leaf.path, f"a {type(value).__name__}", f"{leaf.dtype} numbers", dtype=True)
        value = np.asarray(value)
    if value.dtype != leaf.dtype:
        raise _mismatch(leaf.path, f"of dtype {value.dtype}", f"dtype {leaf.dtype}", dtype=True)
    _check_shape(leaf, value.shape)
    return batch.owned(value)


def _check_shape(leaf: _ElementLeaf, shape: tuple) -> None:
    dims = leaf.dims
    if dims is None:
        return
    if len(dims) != len(shape) or any(d is not None and d != s for d, s in zip(dims, shape, strict=True)):
        raise _mismatch(leaf.path, f"of shape {tuple(shape)}", f"shape {dims}")


# ------------------------------------------------------------------------------ passes
class _DatasetPasses:
    """``from_generator``'s generator: each call is one pass, one ``iter(loader)``.

    The generator's body, and so ``iter(loader)``, runs when TensorFlow asks for the pass's
    first element. A second pass started while another is live raises (a loader runs one
    iteration at a time: starting a second would end the first one's epoch).
    """

    def __init__(self, loader: Any, plan: Any, views: int) -> None:
        self._loader = loader
        self._plan = plan
        self._held = _Held(views)
        self._lock = threading.Lock()
        self._live = False

    def __call__(self) -> Iterator[Any]:
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        with self._lock:
            if self._live:
                raise RuntimeError(
                    "procpipe.tf: a second iterator over this dataset started while another one is still in its "
                    "pass (e.g. Dataset.zip((ds, ds)), or two live iter(ds)). A pass is one iteration of the loader, "
                    "and a loader runs one at a time: finish or drop the first iterator, or build a second loader "
                    "and procpipe.tf.dataset() over it."
                )
            self._live = True
        try:
            plan, held = self._plan, self._held
            for batch in self._loader:
                converted = _HeldBatch(held.room())
                element = _convert(plan, batch, converted)
                del batch  # a copied batch's ring slot is free before TensorFlow holds the element
                if converted.views:
                    held.hold(converted.views)
                del converted
                yield element
        finally:
            self._live = False
