"""torch tensors <-> numpy arrays, for moving tensors through the ring (needs torch).

Imported only where a tensor is met (``procpipe._core.collate``, when a sample holds one) or by
``procpipe.torch``; never by ``import procpipe``. A CPU tensor is viewed as a numpy array
(no copy); dtypes numpy has no equivalent for (bfloat16, float8...) travel as
same-width integers and are viewed back on arrival.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

# dtypes numpy has no equivalent for travel as same-width integers and are viewed back.
BITS_VIEW: dict[torch.dtype, torch.dtype] = {}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # e.g. "ComplexHalf support is experimental"
    for _name in (
        "bfloat16",
        "complex32",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ):
        _dt = getattr(torch, _name, None)
        if not isinstance(_dt, torch.dtype):
            continue
        try:
            torch.empty(1, dtype=_dt).numpy()
        except TypeError:
            _view = _INT_OF_SIZE.get(torch.empty(0, dtype=_dt).element_size())
            if _view is not None:
                BITS_VIEW[_dt] = _view
DTYPE_NAMES = {dt: str(dt).removeprefix("torch.") for dt in BITS_VIEW}


def tensor_numpy(t: torch.Tensor) -> tuple[np.ndarray, torch.dtype | None]:
    """A numpy view of a CPU tensor, and the torch dtype to view it back as (None: same)."""
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        raise TypeError(
            f"procpipe cannot move a {t.device.type} {t.layout} tensor"
            f"{' (quantized)' if t.is_quantized else ''} through shared memory: return dense CPU tensors "
            "from the dataset/collate_fn (move to the GPU in the training loop, or use device=...)"
        )
    t = t.detach().resolve_conj().resolve_neg()
    view = BITS_VIEW.get(t.dtype)
    if view is None:
        return t.numpy(), None
    return t.view(view).numpy(), t.dtype


def numpy_tensor(array: np.ndarray, dtype: torch.dtype | None) -> torch.Tensor:
    """The tensor sharing ``array``'s memory, viewed as ``dtype`` (None: the array's own)."""
    tensor = torch.from_numpy(array)
    return tensor if dtype is None else tensor.view(dtype)


def dtype_name(dtype: torch.dtype | None) -> str:
    """``tensor_numpy``'s second result as a short picklable name ("" for None)."""
    return "" if dtype is None else DTYPE_NAMES[dtype]


def named_tensor(array: np.ndarray, name: str) -> torch.Tensor:
    """``numpy_tensor`` for a ``dtype_name``."""
    return numpy_tensor(array, getattr(torch, name) if name else None)
