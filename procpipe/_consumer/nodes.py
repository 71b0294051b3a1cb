"""The consumer side as small nodes with one contract: ``reset``, ``next``, ``get_state``.

Each stage between the engine and the training loop is an iterator (a ``Node``), in the
manner of torchdata's ``nodes``. A node is built over its child (a source node has
none), and:

- ``next(node)`` returns its next item, or raises ``StopIteration`` at its end;
- ``get_state()`` says where its consumer stands, as a small JSON-serializable dict: a
  *position* (procpipe/_sources/saved_state.py: ``epoch``, what was returned of it and of later
  epochs, ``until``), so that a fresh node of the same kind, ``reset(state)``, yields
  exactly the items not returned yet (and, ordered, in the same order);
- ``reset(initial_state=None)`` restarts the node there (``None``: from the start: where
  the Loader stands, ``loader.epoch``), resetting its child in turn.

Why one contract: resume composes instead of being written per feature. A node that
holds items ahead of its consumer (the device stage's thread, ``prefetch.Prefetcher``)
keeps its child's state *with* each item and reports the state of the last item it
returned, so the items it holds are not counted as returned. A node with no state of
its own (the device stage, ``prefetch.Mapped``) passes its child's state through
unchanged instead of nesting it under a key: the position then does not depend on the
stages over the source, so a state saved with ``Loader(device=...)`` loads into a loader
without one and back. ``Loader.state_dict()`` is the root node's ``get_state()`` with the
sampler's settings (state.py).

The nodes, from the engine up: the sources (``epoch_iterator.EpochIterator``: batches of the
workers' iteration; ``inline.InlineDriver``: ``workers=0``, every source kind), then, with ``device=``,
``prefetch.Prefetcher`` (a prefetching thread) or ``prefetch.Mapped`` (a function per
batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class Node(Iterator):
    """One consumer-side stage: an iterator that can say where it stands and restart there.

    Subclasses implement ``__next__``, ``reset`` and ``get_state`` (see the module's
    docstring for what each promises). A node is its own iterator (``iter(node) is node``).
    """

    def __iter__(self) -> Node:
        return self

    def __next__(self) -> Any:
        raise NotImplementedError

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Restart at ``initial_state`` (a ``get_state()`` of a node of the same kind over the same
        data, possibly through JSON), or from the start with ``None``."""
        raise NotImplementedError

    def get_state(self) -> dict[str, Any]:
        """Where the consumer stands: a JSON-serializable dict that ``reset`` takes back."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop what this node runs besides the consumer (a thread), once its iteration is over;
        nothing by default. ``Loader.close()`` and the next ``iter(loader)`` call it."""
