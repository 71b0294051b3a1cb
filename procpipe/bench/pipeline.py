"""``python -m procpipe.bench --pipeline MODULE:FACTORY``: the user's own pipeline, as a
``workers -> loader`` function (``PipelineMaker``), and what the output says about it.

The factory returns ``procpipe.Loader`` or ``procpipe.torch.DataLoader`` keyword arguments, or
a ready loader (``__main__.FACTORY_HELP``: the contract). The maker sets the worker count the
sweep asks for, leaves out at 0 workers what torch takes only with workers, and keeps the
notes (what it changed or could not measure) and the advice in the loader's own terms.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

from . import sweep

# procpipe.torch.DataLoader's options that torch takes only with workers (num_workers > 0)
_NEED_WORKERS = ("persistent_workers", "prefetch_factor", "multiprocessing_context")


def load_factory(spec: str) -> Callable[..., Any]:
    """``"package.module:name"`` -> the object, importing from the current directory too."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"--pipeline takes MODULE:FACTORY (e.g. mytrain.data:make_loader), got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"--pipeline: cannot import {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SystemExit(f"--pipeline: module {module_name!r} has no {attr!r}") from None
    if not callable(obj):
        raise SystemExit(f"--pipeline: {spec} is not callable")
    return obj


def _facade() -> Any:
    """``procpipe.torch`` if torch is installed (imported only for a facade pipeline)."""
    try:
        import procpipe.torch as facade
    except ImportError:
        return None
    return facade


def _check_keys(kwargs: Mapping[str, Any], target: Any, what: str) -> None:
    """A clear error for a key ``target`` does not take (with the closest valid ones)."""
    import difflib

    params = inspect.signature(target).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    valid = [name for name in params if name != "self"]
    for key in kwargs:
        if key not in params:
            close = difflib.get_close_matches(str(key), valid, n=2)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            raise SystemExit(
                f"--pipeline factory returned {key!r}, which is not a {what} argument{hint}. "
                f"{what} takes: {', '.join(valid)}. See --help for the factory's contract."
            )


class PipelineMaker:
    """``workers -> loader`` for a ``--pipeline`` factory returning kwargs, a Loader or a
    ``procpipe.torch.DataLoader`` (see ``FACTORY_HELP``); it remembers what the output says about
    them: ``front`` (which loader), ``option`` (its worker-count argument), ``theirs`` (the count
    the factory's dict sets, which the sweep replaces), ``arguments`` (the other settings, in
    short) and ``notes`` (what the bench changed or could not measure, each said once)."""

    def __init__(self, factory: Callable[..., Any]) -> None:
        self.factory = factory
        try:
            params = inspect.signature(factory).parameters
            self.takes_workers = "workers" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            self.takes_workers = False
        self.front = "procpipe.Loader"
        self.option = "workers"
        self.theirs: int | None = None
        self.arguments = ""
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def __call__(self, workers: int) -> Any:
        from procpipe import Loader

        made = self.factory(workers=workers) if self.takes_workers else self.factory()
        is_dict = isinstance(made, Mapping)
        facade = _facade() if (is_dict and "dataset" in made) or not (is_dict or isinstance(made, Loader)) else None
        if isinstance(made, Loader) or (facade is not None and isinstance(made, facade.DataLoader)):
            is_facade = facade is not None and isinstance(made, facade.DataLoader)
            if is_facade:
                self.front, self.option = "procpipe.torch.DataLoader", "num_workers"
            # (the facade, procpipe.torch, is typed Any here: mypy does not follow torch)
            have = cast(Any, made).num_workers if is_facade else made.workers_setting
            if have != workers or not isinstance(have, int):
                made.close()
                what = f"{have} workers" if isinstance(have, int) else f"workers={have!r} (autotuned)"
                raise SystemExit(
                    f"--pipeline factory returned a loader with {what} where {workers} were asked: "
                    "to sweep the worker count it must take a workers= argument and build the loader with "
                    "that many, or return the loader's keyword arguments as a dict instead"
                )
            return made
        if isinstance(made, Mapping):
            kwargs = dict(made)
            if "dataset" in kwargs:  # procpipe.torch.DataLoader's arguments
                if facade is None:
                    raise SystemExit(
                        "--pipeline factory returned DataLoader arguments (a 'dataset' key), "
                        "which need torch: pip install procpipe[torch]"
                    )
                self.front, self.option = "procpipe.torch.DataLoader", "num_workers"
                self._remember(kwargs.pop("num_workers", None), kwargs, "dataset")
                _check_keys(kwargs, facade.DataLoader.__init__, "procpipe.torch.DataLoader")
                if workers == 0:
                    self._leave_out_worker_options(kwargs)
                self._pin_memory_note(kwargs)
                # the sweep goes beyond the CPUs on purpose: torch's warning about it would say so at every count
                warnings.filterwarnings("ignore", message="This DataLoader will create")
                # the workers outlive the measured epoch, so their memory and CPU can be read at its end
                kwargs.setdefault("persistent_workers", workers > 0)
                return facade.DataLoader(**kwargs, num_workers=workers)
            self._remember(kwargs.pop("workers", None), kwargs, "source")
            _check_keys(kwargs, Loader.__init__, "procpipe.Loader")
            return Loader(**kwargs, workers=workers)
        raise SystemExit(
            f"--pipeline factory must return a dict of Loader arguments, a Loader or a "
            f"procpipe.torch.DataLoader, got {type(made).__name__}. See --help."
        )

    def _remember(self, theirs: Any, kwargs: dict[str, Any], source_key: str) -> None:
        if isinstance(theirs, int) and not isinstance(theirs, bool):
            self.theirs = theirs
        shown = [f"{k}={_short(v)}" for k, v in kwargs.items() if k != source_key]
        self.arguments = f"{source_key}={_short(kwargs.get(source_key))}" + "".join(f", {a}" for a in shown)

    def _leave_out_worker_options(self, kwargs: dict[str, Any]) -> None:
        """At 0 workers, the options torch's DataLoader refuses without workers, left out (and said)."""
        left = {k: kwargs.pop(k) for k in _NEED_WORKERS if kwargs.get(k) not in (None, False)}
        if left:
            self.note(
                "at 0 workers (loading in the training process) the bench left out "
                + ", ".join(f"{k}={v!r}" for k, v in left.items())
                + ": torch's DataLoader takes them only with num_workers > 0"
            )

    def _pin_memory_note(self, kwargs: dict[str, Any]) -> None:
        if not kwargs.get("pin_memory"):
            return
        import torch

        if torch.accelerator.is_available():
            self.note("pin_memory=True: pinning is part of what was measured (the facade pins in its stage thread)")
            return
        # torch's DataLoader says this at every iteration; the bench says it once
        warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
        self.note(
            "pin_memory=True: this machine has no accelerator, so nothing is pinned: the figures are the "
            "loading alone; measure on the training machine to include pinning"
        )

    def advice(self, recommended: int, settings: list[sweep.Setting]) -> str:
        """What to do, in the loader's own terms, with the factory's own count compared."""
        text = f"set {self.option}={recommended} in your {self.front}"
        if self.theirs is None:
            return text
        if self.theirs == recommended:
            return f"keep {self.option}={recommended} in your {self.front}: it is the recommended count"
        best = max(s.samples_per_s for s in settings) or 1.0
        theirs = next((s for s in settings if s.workers == self.theirs), None)
        if theirs is None:
            return text + f" (yours, {self.option}={self.theirs}, was not measured: add it to --workers)"
        apart = abs(self.theirs - recommended)
        return text + (
            f" (yours, {self.option}={self.theirs}, gave {100 * theirs.samples_per_s / best:.0f} % of the best "
            f"throughput with {apart} {'more' if self.theirs > recommended else 'fewer'} "
            f"worker {'process' if apart == 1 else 'processes'})"
        )


def _short(value: Any) -> str:
    """A setting as the output shows it: its repr if short, else its type."""
    text = repr(value)
    return text if len(text) <= 30 else f"<{type(value).__name__}>"


def loader_maker(factory: Callable[..., Any]) -> PipelineMaker:
    """A ``workers -> loader`` function from a ``--pipeline`` factory (``PipelineMaker``)."""
    return PipelineMaker(factory)


def failed(name: str, workers: int, exc: BaseException) -> str:
    """The message of a pipeline that raised while measured: its error, where, and what to do."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return (
        f"procpipe bench: your pipeline {name} failed with {workers} workers: {type(exc).__name__}: {first}\n"
        "  This is the pipeline's own error (its factory, dataset or functions), not the bench's: fix it and "
        "run again (--traceback shows where it was raised)."
    )
