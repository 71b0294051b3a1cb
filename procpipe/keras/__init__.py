"""Keras 3 adapter: a procpipe loader in ``model.fit`` / ``evaluate`` / ``predict``.

The one-liner::

    import procpipe.keras
    model.fit(procpipe.keras.dataset(train_loader), validation_data=procpipe.keras.dataset(val_loader),
              epochs=10)

Each pass Keras makes over the data (an epoch of ``fit``, one ``evaluate`` or ``predict``
call, each validation run) is one epoch of the loader, whose workers persist: they are
started once, when the loader is created, not once per epoch as Keras' own
``PyDataset`` workers are. ``steps_per_epoch`` smaller than ``len(loader)`` continues
the loader's epoch across Keras epochs, as Keras does for its own datasets.

Batches must be what Keras expects: a tuple ``(x,)``, ``(x, y)`` or
``(x, y, sample_weight)`` (a list is read as a tuple), or a dict of inputs; ``x`` and
``y`` may be arrays or dicts of arrays. Build that shape in the loader's ``fn`` or
``collate_fn``. Ordering and shuffling are the loader's (``Loader(shuffle=True)``);
Keras' ``shuffle=`` argument does not apply.

Tested on the tensorflow, jax and torch backends. On TensorFlow the loader goes through
``procpipe.tf.dataset`` (exact ``element_spec``, ring slots handed back at once). Keras
looks at one batch to build a model or its metrics before the first epoch; that pass is
then put back (``load_state_dict``), so ``loader.epoch`` advances by exactly ``epochs``
and the first epoch trained on is the loader's next one, whole. Import this module after
choosing the backend (``KERAS_BACKEND`` must be set before Keras is first imported).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeAlias

import numpy as np
from keras import ops, tree
from keras.utils import PyDataset

from .._ext import returned_nothing

try:  # Keras >= 3.x accepts a DataAdapter instance as `x`: exact epoch boundaries
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter as _DataAdapter
except ImportError:  # pragma: no cover - older Keras: the PyDataset protocol alone
    _DataAdapter = object

__all__ = ["KerasDataset", "dataset"]

#: ``element_spec=``: a nest (dict, tuple, namedtuple) of ``tf.TypeSpec``, as ``procpipe.tf`` takes it.
ElementSpec: TypeAlias = Any


def dataset(loader: Any, *, element_spec: ElementSpec = None) -> KerasDataset:
    """Wrap ``loader`` (a ``procpipe.Loader`` or ``procpipe.torch.DataLoader``) for Keras.

    ``element_spec`` matters on the TensorFlow backend only (``procpipe.tf.dataset``'s
    argument: by default inferred from the loader's next batch, which is put back).
    """
    return KerasDataset(loader, element_spec=element_spec)


def _standardize(batch: Any) -> Any:
    if isinstance(batch, dict):
        return batch
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple):
        batch = (batch,)
    if not 1 <= len(batch) <= 3:
        raise ValueError(
            f"procpipe.keras: a batch must be (x,), (x, y), (x, y, sample_weight) or a dict of inputs; "
            f"got a {type(batch).__name__} of {len(batch)} items. Reshape it in the loader's fn or collate_fn."
        )
    return batch


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or (hasattr(x, "__array__") and hasattr(x, "dtype"))


def _to_numpy(x: Any) -> Any:
    if isinstance(x, np.ndarray) or not _is_array(x):
        return x
    if hasattr(x, "cpu"):  # a torch tensor (Loader(device=...) or procpipe.torch.DataLoader)
        x = x.detach().cpu()
    return np.asarray(x)


def _start_state(loader: Any) -> dict[str, Any] | None:
    """``loader.state_dict()`` if the iteration just started is at the start of an epoch (so
    that putting it back replays that epoch whole), else None (nothing to put back)."""
    save = getattr(loader, "state_dict", None)
    if not (callable(save) and callable(getattr(loader, "load_state_dict", None))):
        return None
    state = save()
    return state if returned_nothing(state) else None


# (keras is typed Any for mypy, installed or not: pyproject's [tool.mypy] overrides)
class KerasDataset(PyDataset, _DataAdapter):  # type: ignore[misc]  # subclassing Any: keras' classes
    """A procpipe loader as Keras input data.

    A ``keras.utils.PyDataset`` (so anything that accepts one accepts it) that is also a
    Keras ``DataAdapter``, so ``fit``/``evaluate``/``predict`` iterate the loader
    directly: one pass = ``iter(loader)`` = one loader epoch, with the loader's own
    workers, order and prefetching. Keras' thread/process pool is never used.

    ``ds[i]`` (the plain ``PyDataset`` protocol, used by Keras versions without
    ``DataAdapter`` inputs) returns the loader's next batch, whatever ``i``: the batches
    form one continuous stream of loader epochs.
    """

    def __init__(self, loader: Any, element_spec: ElementSpec = None) -> None:
        if not (hasattr(loader, "__iter__") and hasattr(loader, "__len__")):
            raise TypeError(
                f"procpipe.keras.dataset needs a loader with __iter__ and __len__, got {type(loader).__name__}"
            )
        super().__init__(workers=1, use_multiprocessing=False, max_queue_size=1)
        self.loader = loader
        self._stream: Iterator[Any] | None = None
        self._element_spec = element_spec
        self._tf_dataset: Any = None
        self._abandoned: dict[str, Any] | None = None  # where a pass closed after its first batch had started

    # ---------------------------------------------------------------- PyDataset
    def __len__(self) -> int:
        return len(self.loader)

    @property
    def num_batches(self) -> int:
        return len(self.loader)

    def __getitem__(self, index: int) -> Any:
        if self._stream is None:
            self._stream = iter(self.loader)
        try:
            batch = next(self._stream)
        except StopIteration:
            self._stream = iter(self.loader)
            batch = next(self._stream)
        return _standardize(batch)

    def on_epoch_begin(self) -> None:
        self._abandoned = None

    def on_epoch_end(self) -> None:
        """Keras' end of a pass. After its look at one batch to build the model (``reset()``:
        the pass is dropped after one batch, then this), the loader is put back where that
        pass started, so the first epoch Keras trains on is the loader's next one, whole."""
        state, self._abandoned = self._abandoned, None
        if state is not None:
            self.loader.load_state_dict(state)

    # ---------------------------------------------------------------- DataAdapter
    def _epoch(self) -> Iterator[Any]:
        """One pass: one ``iter(loader)``, started when its first batch is asked for."""
        self._stream = None  # the stream protocol restarts after a pass
        batches = iter(self.loader)
        start = _start_state(self.loader)
        taken, finished = 0, False
        try:
            for batch in batches:
                taken += 1
                yield _standardize(batch)
            finished = True
        finally:
            self._abandoned = start if not finished and taken == 1 else None

    def get_numpy_iterator(self) -> Iterator[Any]:
        for batch in self._epoch():
            yield tree.map_structure(_to_numpy, batch, none_is_leaf=False)

    def get_jax_iterator(self) -> Iterator[Any]:
        return self.get_numpy_iterator()

    def get_torch_dataloader(self) -> Any:
        return _TorchBatches(self)

    def get_tf_dataset(self) -> Any:
        """The loader as a ``tf.data.Dataset`` (``procpipe.tf.dataset``), built once: each pass
        over it is one ``iter(loader)``; its spec is that of the first batch, put back."""
        if self._tf_dataset is None:
            from .. import tf as procpipe_tf  # imports TensorFlow: only on that backend

            reserve = getattr(self.loader, "reserve_stage_slots", None)
            if callable(reserve):  # the ring slots TensorFlow holds (procpipe.tf.dataset's views)
                reserve(procpipe_tf.VIEWS)
            spec = self._element_spec
            if spec is None:
                spec = procpipe_tf.element_spec(self.loader, map_batch=_standardize)
            self._tf_dataset = procpipe_tf.dataset(_KerasPasses(self), element_spec=spec)
        return self._tf_dataset

    @property
    def batch_size(self) -> int | None:
        return None

    @property
    def has_partial_batch(self) -> bool | None:
        return None

    @property
    def partial_batch_size(self) -> int | None:
        return None


class _KerasPasses:
    """The passes of a ``KerasDataset`` as ``procpipe.tf.dataset`` iterates them: standardized batches."""

    def __init__(self, owner: KerasDataset) -> None:
        self._owner = owner

    def __iter__(self) -> Iterator[Any]:
        return self._owner._epoch()


class _TorchBatches:
    """One pass per ``iter()``, leaves as backend tensors (zero-copy on CPU)."""

    def __init__(self, owner: KerasDataset) -> None:
        self._owner = owner

    def __iter__(self) -> Iterator[Any]:
        convert = lambda x: ops.convert_to_tensor(x) if _is_array(x) else x  # noqa: E731
        for batch in self._owner._epoch():
            yield tree.map_structure(convert, batch, none_is_leaf=False)
