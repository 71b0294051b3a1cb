"""JAX adapter: a procpipe loader's batches as global ``jax.Array``s, sharded, copied ahead, resumable.

```python
import procpipe, procpipe.jax

loader = procpipe.Loader(records, preprocess, batch_size=64, workers=4, shuffle=True,
                         shard=procpipe.jax.shard())          # this process's rows of each batch
batches = procpipe.jax.iterator(loader)                       # NamedSharding(mesh, P("data"))
for epoch in range(10):
    for batch in batches:                                     # one pass = one epoch of the loader
        state = train_step(state, batch)                      # batch["image"]: a global jax.Array
```

- **Global arrays, sharded.** Every numeric numpy array of a batch (in dicts, tuples,
  namedtuples, lists) becomes a ``jax.Array`` laid out by ``sharding`` (default: every
  device on one mesh axis ``"data"``, the first dimension split over it), made with
  ``jax.make_array_from_process_local_data``; strings, lists of them and object arrays
  stay as they are.
- **Copied ahead.** A thread makes the next ``prefetch`` batches' arrays while the step
  runs (procpipe's own device-stage thread, ``procpipe._ext.Prefetcher``).
- **Multi-process.** Each process loads its rows (``shard=procpipe.jax.shard(sharding)``:
  ``(jax.process_index(), jax.process_count())`` by default, checked by :func:`iterator`);
  processes whose batches differ in size get an error naming every size, not a hang.
- **Exact resume.** ``loader.state_dict()`` counts the batches the loop took, not those
  made ahead; :class:`LoaderSave` / :class:`LoaderRestore` save and restore it with the
  model in an Orbax checkpoint (``procpipe.combine_states`` when the number of processes
  changed). They import ``orbax.checkpoint`` when first used.

``import procpipe`` never imports this package (nor JAX). See docs/guide/jax.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .arrays import default_sharding, shard
from .passes import GlobalBatches, iterator

if TYPE_CHECKING:
    from .checkpoint import LoaderCheckpointHandler, LoaderRestore, LoaderSave

__all__ = [
    "GlobalBatches",
    "LoaderCheckpointHandler",
    "LoaderRestore",
    "LoaderSave",
    "default_sharding",
    "iterator",
    "shard",
]

_ORBAX = ("LoaderCheckpointHandler", "LoaderRestore", "LoaderSave")


def __getattr__(name: str) -> Any:
    """The Orbax names, imported on first use (``orbax.checkpoint`` is optional and slow to import)."""
    if name in _ORBAX:
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'procpipe.jax' has no attribute {name!r}")
