"""Imported once by the forkserver process: preload what workers will need.

``PROCPIPE_PRELOAD`` (set only while the forkserver starts) lists the third-party
packages the parent had imported. Importing them here, once, lets every worker forked
from the server start in milliseconds. A package that fails to import here is skipped:
the worker will import it itself (and report the error) if it really needs it.
"""
import importlib
import os

import procpipe.worker  # noqa: F401  (the worker's own code and numpy)

for _name in filter(None, os.environ.get("PROCPIPE_PRELOAD", "").split(",")):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - best effort by design, see the docstring
        pass
