"""Which modules a forkserver preloads: those the shipped dataset and functions reference.

A worker started from the forkserver unpickles the loader's spec (cloudpickle, or dill:
process.dump_spec), which imports every module a class or function in it lives in. Imported once in the server instead,
they cost nothing per worker. Only those: a process that imported TensorFlow or torch
for its training loop does not make a numpy-only dataset's workers wait for them (10 s
for TensorFlow). The list is read off the pickle itself (``referenced_modules``: its
``GLOBAL`` / ``STACK_GLOBAL`` opcodes, and the modules cloudpickle and dill pickle by
reference: the argument of their import function), and
ordered as the parent imported them (``sys.modules`` keeps that order), so that a module
whose import depends on another's having run first (a plugin registry, a post-import hook)
is imported after it, as in the parent. Modules imported only inside a function body are
not referenced: each worker imports those itself.
"""

from __future__ import annotations

import pickletools
import sys
from typing import cast

_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})
_GET_OPS = frozenset({"BINGET", "LONG_BINGET", "GET"})
_NO_STACK_OPS = frozenset({"FRAME", "PROTO", "STOP"})
# (module, name) of the functions cloudpickle's and dill's pickles call to import a module pickled by reference
_IMPORT_MODULE = frozenset({("cloudpickle.cloudpickle", "subimport"), ("dill._dill", "_import_module")})
# Already imported by every worker: never worth listing.
_ALWAYS_THERE = frozenset(
    {
        "__main__",
        "builtins",
        "__builtin__",
        "copyreg",
        "dill",
        "dill._dill",
        "cloudpickle",
        "cloudpickle.cloudpickle",
        "numpy",
    }
)


def referenced_modules(data: bytes) -> set[str]:
    """The modules a pickle imports when it is loaded (module doc)."""
    modules: set[str] = set()
    memo: dict[int, str | None] = {}
    recent: list[str | None] = [None, None]  # the last two values pushed (None: not a string)
    want_module = False  # the next string is the argument of an _IMPORT_MODULE function
    for opcode, arg, _ in pickletools.genops(data):
        name = opcode.name
        value: str | None = None
        if name in _STRING_OPS:
            value = arg
        elif name in _GET_OPS:
            value = memo.get(cast(int, arg))  # (pickletools types every argument as Any | None)
        elif name == "MEMOIZE":
            memo[len(memo)] = recent[-1]
            continue
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[cast(int, arg)] = recent[-1]
            continue
        elif name in _NO_STACK_OPS:
            continue
        elif name == "STACK_GLOBAL" or name == "GLOBAL":
            module, attr = (recent[-2], recent[-1]) if name == "STACK_GLOBAL" else str(arg).split(" ", 1)
            if module is not None:
                modules.add(module)
                want_module = (module, attr) in _IMPORT_MODULE
            recent.append(None)
            del recent[0]
            continue
        if value is not None and want_module:
            modules.add(value)
            want_module = False
        recent.append(value)
        del recent[0]
    return modules


def preload_list(data: bytes) -> list[str]:
    """The modules for a forkserver to preload before it forks workers that unpickle ``data``:
    those it references that this process has imported, in the order it imported them."""
    wanted = referenced_modules(data) - _ALWAYS_THERE
    return [name for name in list(sys.modules) if name in wanted]
