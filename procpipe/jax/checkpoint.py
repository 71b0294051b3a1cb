"""A procpipe loader's position in an Orbax checkpoint: ``LoaderSave`` / ``LoaderRestore``.

```python
import orbax.checkpoint as ocp
import procpipe.jax

manager.save(step, args=ocp.args.Composite(
    state=ocp.args.StandardSave(model_state), loader=procpipe.jax.LoaderSave(loader)))
...
restored = manager.restore(step, args=ocp.args.Composite(
    state=ocp.args.StandardRestore(abstract_state), loader=procpipe.jax.LoaderRestore(loader)))
```

Both are ``CheckpointArgs`` registered with :class:`LoaderCheckpointHandler`, so a
``CheckpointManager`` (``Composite`` args) needs no ``item_handlers``. Each process writes its
loader's ``state_dict()`` (a small JSON dict) to ``process_<i>-of-<n>.json`` of the item's
directory. On restore, a process reads its own file when the job has as many processes as the
saved one; with another number, it reads every saved process's file and loads
``procpipe.combine_states`` of them (its loader built with its new ``shard=``), so across the
new processes every sample the old ones had not returned comes exactly once.

The state is taken when ``LoaderSave`` is made (at ``manager.save``, in the training loop's
thread), not when Orbax writes it, so an asynchronous save records the batches the loop had
taken at that step.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from .. import combine_states

__all__ = ["LoaderCheckpointHandler", "LoaderRestore", "LoaderSave", "saved_states"]

_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")


def _file_name(index: int, count: int) -> str:
    return f"process_{index}-of-{count}.json"


def saved_states(directory: Any) -> list[dict[str, Any]]:
    """Every process's saved state in an item's ``directory``, in process order.

    Raises:
        FileNotFoundError: no saved state there.
        ValueError: the files are of several process counts, or a process's file is missing.
    """
    found: dict[int, dict[int, Path]] = {}
    for path in Path(str(directory)).iterdir():
        match = _FILE.fullmatch(path.name)
        if match:
            found.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    if not found:
        raise FileNotFoundError(f"procpipe.jax: no loader state (process_<i>-of-<n>.json) in {directory}")
    if len(found) > 1:
        raise ValueError(
            f"procpipe.jax: {directory} holds loader states of {sorted(found)} processes; one save writes one count"
        )
    ((count, files),) = found.items()
    missing = sorted(set(range(count)) - set(files))
    if missing:
        raise ValueError(
            f"procpipe.jax: {directory} lacks the loader state of process(es) {missing} of {count} "
            "(a save whose processes did not all write)"
        )
    return [json.loads(files[i].read_text()) for i in range(count)]


class LoaderCheckpointHandler(ocp.CheckpointHandler):  # type: ignore[misc]
    """Orbax ``CheckpointHandler`` for a procpipe loader's ``state_dict()`` (see the module)."""

    def save(self, directory: Any, args: LoaderSave) -> None:
        name = _file_name(jax.process_index(), jax.process_count())
        (Path(str(directory)) / name).write_text(json.dumps(args.state))

    def restore(self, directory: Any, args: LoaderRestore | None = None) -> dict[str, Any]:
        """This process's state (the saved one, or ``combine_states`` of every saved process's
        when the process count changed), loaded into ``args.loader`` if given; returned."""
        own = Path(str(directory)) / _file_name(jax.process_index(), jax.process_count())
        if own.exists():
            state: dict[str, Any] = json.loads(own.read_text())
        else:
            state = combine_states(saved_states(directory))
        loader = None if args is None else args.loader
        if loader is not None:
            loader.load_state_dict(state)
        return state

    def metadata(self, directory: Any) -> None:
        return None

    def finalize(self, directory: Any) -> None:
        return None

    def close(self) -> None:
        return None


@ocp.args.register_with_handler(LoaderCheckpointHandler, for_save=True)
@dataclasses.dataclass
class LoaderSave(ocp.args.CheckpointArgs):  # type: ignore[misc]
    """Save a loader's position with the checkpoint: ``LoaderSave(loader)`` takes its
    ``state_dict()`` now (or pass a state dict)."""

    loader: Any
    state: dict[str, Any] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        source = self.loader
        if isinstance(source, dict):
            self.state = source
        elif callable(getattr(source, "state_dict", None)):
            self.state = source.state_dict()
        else:
            raise TypeError(
                f"procpipe.jax.LoaderSave takes a procpipe.Loader (or its state_dict()), got {type(source).__name__}"
            )
        self.loader = None  # the state is what is saved: the loader is not held by Orbax


@ocp.args.register_with_handler(LoaderCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class LoaderRestore(ocp.args.CheckpointArgs):  # type: ignore[misc]
    """Restore a loader's position: ``LoaderRestore(loader)`` loads it into the loader (whose
    next pass resumes there); ``LoaderRestore()`` only returns the state."""

    loader: Any = None
