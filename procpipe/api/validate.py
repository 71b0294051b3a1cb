"""The checks of ``Loader``'s arguments that involve the source, before anything starts.

Every other argument is checked by its group of the configuration (``api/config.py``,
``core/config.py``), when ``LoaderConfig.from_arguments`` makes it. What is left here needs the
source itself: that it is one ``Loader`` can read, and ``batches=`` against a ``Mix``. A
streaming source's own options are checked by ``streaming.StreamPlan``, the cache's layout by
``cache.open_cache``.
"""

from __future__ import annotations

from typing import Any

from ..plan.mix import Mix
from ..streaming import Shards
from ..worker.start_method import START_METHODS

__all__ = ["START_METHODS", "validate_source"]  # (START_METHODS: procpipe.torch reads it here)


def validate_source(source: Any, batches: Any = None) -> None:
    """Check ``source`` (and ``batches``, the other arguments being valid); raise on the first one wrong."""
    if not isinstance(source, Shards) and not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise TypeError(
            f"source must support len() and indexing with an int (a list, a numpy array, a torch Dataset...); "
            f"got {type(source).__name__}, which lacks "
            f"{'__len__' if not hasattr(source, '__len__') else '__getitem__'}. Wrap iterables in a list first."
        )
    if batches is not None and isinstance(source, Mix):
        raise ValueError(
            "a procpipe.Mix draws each epoch's order from its weights, but this Loader was also "
            "given batches=..., which would replace it: leave batches= out to mix by weight"
        )
