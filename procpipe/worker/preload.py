"""Imported once by the forkserver process: preload what workers will need.

``PROCPIPE_PRELOAD_FILE`` (set only while the forkserver starts) names a file listing
the modules the parent had imported. Importing them here, once, lets every worker
forked from the server start in milliseconds. A module that fails to import here is
skipped: the worker will import it itself (and report the error) if it really needs it.
"""
import importlib
import os

import procpipe.worker.process  # noqa: F401  (the worker's own code and numpy)
from procpipe.core.shm import open_owned


def _preload(path: str) -> None:
    try:
        with os.fdopen(open_owned(path, os.O_RDONLY)) as f:  # the loader's own file only
            names = f.read().split()
    except OSError:
        return
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - best effort by design, see the docstring
            pass


_preload(os.environ.get("PROCPIPE_PRELOAD_FILE", ""))
