"""The harness of the user-code corpus (tests/test_user_code.py): runs a script's patterns.

Each script of this folder is a user's own training script: it defines its datasets and
functions in ``__main__`` (as a script or a notebook does), then calls ``run(patterns)``
under its ``if __name__ == "__main__":`` guard. ``python SCRIPT.py METHOD`` loads every pattern

- serially in this process (``workers=0``: what the script computes; the expected batches),
- through ``procpipe.Loader(..., workers=2, start_method=METHOD)`` (one worker with spawn: ``workers``),
- through ``procpipe.torch.DataLoader(..., num_workers=2, multiprocessing_context=METHOD)``,
- through ``torch.utils.data.DataLoader`` with the same arguments: with ``fork`` workers (the
  output of these deterministic patterns does not depend on the start method), and for the
  patterns marked ``torch_same_method`` under METHOD itself where torch has it (no zygote;
  spawn and forkserver need what the workers get to be importable from the re-imported main
  script, which a closure is not): torch's spawn and forkserver import the whole script and
  torch in every worker, seconds each, so the corpus pays for them where they show something,


and prints one JSON line per pattern (an error is printed as its first line, so one broken
pattern does not hide the others). This module holds no pattern: the workers import it by
reference where a pattern names it, and the patterns are all in the scripts.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import procpipe
import procpipe.torch

BATCH = 4
# Two workers, as the reproduction has; one with spawn, where each worker is a fresh
# interpreter importing torch (seconds on a loaded 2-core machine): what is shipped, and how,
# is the same for every worker.
WORKERS = 2
TORCH_METHODS = ("fork", "forkserver", "spawn")


@dataclasses.dataclass
class Pattern:
    """One thing users write: ``dataset`` (and ``fn`` for ``Loader``), loaded every way above.

    ``loader``: whether ``procpipe.Loader`` takes it (a torch ``IterableDataset`` goes through
    the facade only); ``torch_same_method``: run torch's own DataLoader under METHOD too (the
    module doc);
    ``facade``: extra keyword arguments for both DataLoaders (``collate_fn``, ``worker_init_fn``).
    """

    name: str
    dataset: Any
    fn: Callable[..., Any] | None = None
    loader: bool = True
    torch_same_method: bool = False
    facade: dict[str, Any] = dataclasses.field(default_factory=dict)


def plain(value: Any) -> Any:
    """``value`` as JSON: arrays and tensors as lists, tuples as lists, dicts with sorted keys, a
    dataclass instance as its fields and whether its class is the script's very class."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        script_class = getattr(sys.modules["__main__"], cls.__qualname__, None)
        return {"class": cls.__qualname__, "the_scripts_class": cls is script_class, **plain(vars(value))}
    if isinstance(value, (np.ndarray, np.generic, torch.Tensor)):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _first_line(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text.splitlines()[-1] if text else type(exc).__name__


def _attempt(load: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    try:
        return {"batches": plain(load()), "s": round(time.perf_counter() - started, 2)}
    except Exception as exc:  # noqa: BLE001 - reported, the other patterns still run
        return {"error": _first_line(exc), "traceback": traceback.format_exc()[-3000:]}


def workers(method: str) -> int:
    return 1 if method == "spawn" else WORKERS


def _loader(pattern: Pattern, method: str, workers: int) -> list:
    with procpipe.Loader(pattern.dataset, pattern.fn, batch_size=BATCH, workers=workers, start_method=method) as ld:
        return list(ld)


def _facade(pattern: Pattern, context: str, resolved: list[str]) -> list:
    loader = procpipe.torch.DataLoader(
        pattern.dataset,
        batch_size=BATCH,
        num_workers=workers(str(context)),
        multiprocessing_context=context,
        **pattern.facade,
    )
    batches = list(loader)
    resolved.append(loader.start_method)
    return batches


def _torch(pattern: Pattern, method: str) -> list:
    same = pattern.torch_same_method and method in TORCH_METHODS
    loader = torch.utils.data.DataLoader(
        pattern.dataset,
        batch_size=BATCH,
        num_workers=workers(method),  # (an IterableDataset's batches depend on the count)
        multiprocessing_context=method if same else "fork",
        **pattern.facade,
    )
    return list(loader)


def run(patterns: list[Pattern], method: str | None = None) -> None:
    """Load every pattern every way (module doc); one JSON line each on stdout."""
    method = method or sys.argv[1]
    for pattern in patterns:
        line: dict[str, Any] = {"pattern": pattern.name, "method": method}
        resolved: list[str] = []
        # The facade first: a forkserver started by it preloads torch for every later loader's
        # workers (a server keeps what the loader that started it preloaded: startup.md).
        line["facade"] = _attempt(lambda p=pattern, r=resolved: _facade(p, method, r))
        line["facade_method"] = resolved[0] if resolved else None
        if pattern.loader:
            line["expected"] = _attempt(lambda p=pattern: _loader(p, "fork", 0))
            line["loader"] = _attempt(lambda p=pattern: _loader(p, method, workers(method)))
        line["torch"] = _attempt(lambda p=pattern: _torch(p, method))
        print(json.dumps(line), flush=True)
