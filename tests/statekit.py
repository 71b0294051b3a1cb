"""Sources and loaders whose mid-epoch states are saved in ``tests/data/states_v1/``.

``PYTHONPATH=.:tests python -c "import statekit; statekit.write()"`` writes, for each case,
``<case>.json``: the loader's ``state_dict()`` taken after ``CUT`` batches of a shuffled
epoch, and the batches an uninterrupted run yields after it (``combined``: the state
``combine_states`` makes of two ranks' states, and the batches three ranks yield after loading
it). The files were written by the code of the saved-state format version 1 (``mix_stream``,
``combined`` and ``caller`` by e24b893's, before issue 44's restructuring:
``statekit.write(["mix_stream", "combined", "caller"])`` run in a checkout of it);
``tests/test_saved_states.py`` loads each into a loader built here and checks that it resumes
exactly there, so a change of the state's format (or of what it means) fails that test.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).resolve().parent / "data" / "states_v1"
CUT = 3
SHARDS = [(0, 7), (1, 0), (2, 9), (3, 12), (4, 2)]


def open_shard(shard):
    for i in range(shard[1]):
        yield shard[0] * 100 + i


class CallerBatches:
    """``batches=``: each epoch's batches chosen by the caller (a reversed, epoch-rotated order of
    4-index batches), with a ``len()`` (the loader's)."""

    def __call__(self, epoch: int) -> list[list[int]]:
        order = [(i * 7 + epoch * 3) % 30 for i in range(30)]
        return [order[i : i + 4] for i in range(0, 30, 4)][::-1]

    def __len__(self) -> int:
        return 8


def make_loader(case: str, shard: tuple[int, int] | None = None) -> Any:
    """A fresh loader of ``case`` (``loader``, ``mix``, ``shards``, ``mix_stream``, ``combined``
    (rank ``shard`` of a sharded stream), ``caller``, ``torch_map``, ``torch_iterable``)."""
    from procpipe import Loader, Mix, Shards

    if case == "mix_stream":
        source = Mix([Shards(SHARDS, open_shard, cycle_length=2, block_length=3), list(range(500, 517))], [0.6, 0.4],
                     shard_size=5)
        return Loader(source, batch_size=4, shuffle=True, seed=11, epochs=2, with_epoch=True)
    if case == "combined":
        return Loader(list(range(40)), batch_size=3, shuffle=True, seed=11, epochs=2, with_epoch=True, shard=shard)
    if case == "caller":
        return Loader(list(range(30)), batches=CallerBatches(), epochs=2, with_epoch=True)
    if case == "loader":
        return Loader(list(range(30)), batch_size=4, shuffle=True, seed=11, epochs=2, with_epoch=True)
    if case == "mix":
        source = Mix([list(range(100, 112)), Mix([list(range(200, 205)), list(range(300, 313))], [1, 2])],
                     lambda epoch: [0.2 + 0.3 * epoch, 0.5])
        return Loader(source, batch_size=4, shuffle=True, seed=11, epochs=2, with_epoch=True)
    if case == "shards":
        source = Shards(SHARDS, open_shard, cycle_length=2, block_length=3)
        return Loader(source, batch_size=4, shuffle=True, seed=11, epochs=2, with_epoch=True)
    import torch
    import torch.utils.data as tud

    from procpipe.torch import DataLoader

    if case == "torch_map":
        return DataLoader(tud.TensorDataset(torch.arange(26)), batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(5))
    if case == "torch_iterable":
        return DataLoader(Counting(), batch_size=4, generator=torch.Generator().manual_seed(7))
    raise ValueError(case)


try:
    import torch.utils.data as _tud
except ImportError:  # torch absent: the torch cases skip (tests/test_saved_states.py)
    _tud = None

HAVE_TORCH = _tud is not None

if HAVE_TORCH:

    class Counting(_tud.IterableDataset):
        """0..29, as plain ints: no state of its own (the DataLoader counts what it returned)."""

        def __iter__(self):
            return iter(range(30))


CASES = ("loader", "mix", "shards", "mix_stream", "combined", "caller", "torch_map", "torch_iterable")
COMBINED_FROM, COMBINED_TO = 2, 3  # ``combined``: the world sizes saved and loaded


def plain(batch: Any) -> Any:
    """A batch as JSON: nested lists of ints (an epoch tag kept as the pair's first item)."""
    if isinstance(batch, (tuple, list)):
        return [plain(b) for b in batch]
    if hasattr(batch, "numpy"):
        batch = batch.numpy()
    if isinstance(batch, np.ndarray):
        return batch.tolist()
    return int(batch) if isinstance(batch, (int, np.integer)) else batch


def cut(case: str) -> tuple[dict[str, Any], list[Any]]:
    """The state after ``CUT`` batches, and every batch after it (the rest of the epochs);
    ``combined``: every rank's state after ``CUT`` batches combined, and what the ranks of the
    new world yield after loading it."""
    if case == "combined":
        from procpipe import combine_states

        states = [_cut_one(case, (rank, COMBINED_FROM))[0] for rank in range(COMBINED_FROM)]
        state = json.loads(json.dumps(combine_states(states)))
        return state, resume(case, state)
    return _cut_one(case, None)


def _cut_one(case: str, shard: tuple[int, int] | None) -> tuple[dict[str, Any], list[Any]]:
    loader = make_loader(case, shard)
    epochs = 1 if case.startswith("torch") else None
    try:
        it = iter(loader)
        for _ in range(CUT):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
        rest = [plain(b) for b in it]
        if epochs == 1:  # a torch DataLoader's next epoch, too
            rest += [plain(b) for b in loader]
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return state, rest


def resume(case: str, state: dict[str, Any]) -> list[Any]:
    """The batches a fresh loader yields after ``load_state_dict(state)`` (``combined``: each
    rank's of the new world, one list per rank)."""
    if case == "combined":
        return [_resume_one(case, state, (rank, COMBINED_TO)) for rank in range(COMBINED_TO)]
    return _resume_one(case, state, None)


def _resume_one(case: str, state: dict[str, Any], shard: tuple[int, int] | None) -> list[Any]:
    loader = make_loader(case, shard)
    try:
        loader.load_state_dict(state)
        rest = [plain(b) for b in loader]
        if case.startswith("torch"):
            rest += [plain(b) for b in loader]
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return rest


def write(cases: Any = CASES) -> None:
    """Write ``<case>.json`` of each of ``cases`` (all by default) from the code imported."""
    DATA.mkdir(parents=True, exist_ok=True)
    for case in cases:
        state, rest = cut(case)
        (DATA / f"{case}.json").write_text(json.dumps({"state": state, "rest": rest}, sort_keys=True, indent=1) + "\n")
        print(case, len(rest), "batches after the cut")

