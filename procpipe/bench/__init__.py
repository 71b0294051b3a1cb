"""procpipe's benchmark tooling.

- ``python -m procpipe.bench`` (or ``procpipe-bench``): sweep the worker count on the
  reference workloads or on your own pipeline (``--pipeline module:factory``) and get a
  recommendation; see ``procpipe/bench/__main__.py`` and docs/benchmarks.md#what-it-prints.
- :mod:`procpipe.bench.workloads`: the reference workloads (docs/benchmarks.md#performance-goals), shared with
  ``bench/compare.py`` (procpipe beside PyTorch's DataLoader, Pool.imap and serial).
"""

from .sweep import Setting, default_worker_counts, measure, recommend
from .workloads import WORKLOADS, Workload

__all__ = ["WORKLOADS", "Setting", "Workload", "default_worker_counts", "measure", "recommend"]
