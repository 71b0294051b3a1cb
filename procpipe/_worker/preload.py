"""Imported once by the forkserver process: preload what workers will need.

``PROCPIPE_PRELOAD`` (set only while the forkserver starts) is the address of the loader's
segment of shared memory (``pid:fd:device:inode``, shm.py ``proc_address``) holding a JSON list of
the parent's ``sys.path`` and the modules the shipped dataset and functions reference
(``preload_list``), in the order the parent imported them. Importing them here, once, lets
every worker forked from the server start in milliseconds. A module that fails to import
here is reported (a ``PreloadWarning`` on the server's stderr, which is the parent's,
naming the module and the exception): the server goes on, and a worker that needs the
module imports it itself (and fails with the error, if it fails there too).
"""

import importlib
import json
import os
import sys
import traceback
import warnings

import procpipe._worker.process  # noqa: F401  (the worker's own code and numpy)
from procpipe._core.shm import open_proc_address


class PreloadWarning(UserWarning):
    """A module the forkserver was to preload failed to import there."""


def preload(names: list[str]) -> list[tuple[str, str]]:
    """Import ``names`` in order; ``(module, error)`` for each that failed, each one warned about."""
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported, then the server goes on (module doc)
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            failed.append((name, error))
            warnings.warn(
                f"procpipe: the forkserver could not preload module {name!r}: {error}. Workers "
                "that need it import it themselves (and fail with this error if it fails there too); "
                "a module whose import depends on the process it runs in should be imported inside "
                "fn or __getitem__ instead.",
                PreloadWarning,
                stacklevel=2,
            )
    return failed


def _preload_listing(address: str) -> None:
    if not address:
        return
    try:
        with os.fdopen(open_proc_address(address.split(":"))) as f:  # the loader's own segment only
            listing = json.load(f)
    except (OSError, ValueError) as exc:
        warnings.warn(
            f"procpipe: the forkserver could not read its module list ({address}): {exc}", PreloadWarning, stacklevel=1
        )
        return
    # The parent's sys.path (its script's directory, a path added by the program): multiprocess
    # gives it to each worker, not to the server, where the same modules are imported first.
    sys.path[:] = listing["sys_path"]
    preload(listing["modules"])


_preload_listing(os.environ.get("PROCPIPE_PRELOAD", ""))
