"""The one codec of a sample's tree, shared by collation and the cache.

A sample (and a batch) is a tree of mappings and sequences over leaves. Collation describes a
batch in a ring slot by its *layout* (``collate.py``: ``[ARRAY, ...]`` a stacked array in the
slot, ``[INLINE, value]`` a value pickled with the reply, ``[DICT, keys, children]``,
``[SEQ, type, children]``); the cache describes a stored sample by its *skeleton*
(``_worker/cache_file.py`` ``Layout``: the same ``DICT`` and ``SEQ`` nodes over ``[LEAF, field]``).
One set of tags, so a node means the same wherever it is read; a layout or a skeleton travels
only between the processes of one loader (in a reply, or in the ``WorkerSpec``) and is never
saved, so the numbers may change between versions.
"""

from __future__ import annotations

from typing import Any

ARRAY, INLINE, DICT, SEQ, LEAF = 0, 1, 2, 3, 4


def path_str(path: tuple) -> str:
    """Where a node is in its sample, as an error names it: ``sample['image'][0]``."""
    return "sample" + "".join(f"[{p!r}]" for p in path)


def seq_type(value: Any) -> type:
    """The sequence type a node is built back as: a tuple, a list or a named tuple as given,
    any other sequence as a list."""
    return type(value) if type(value) in (tuple, list) or hasattr(value, "_fields") else list


__all__ = ["ARRAY", "DICT", "INLINE", "LEAF", "SEQ", "path_str", "seq_type"]
