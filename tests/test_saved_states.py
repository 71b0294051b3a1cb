"""The saved-state promise (docs/guide/resume.md, "Which saved states load"; CHANGELOG.md): a state
saved by procpipe 0.1.0 or later loads into every later release and resumes exactly, and a state
of a format this release does not know is refused, never misread.

``tests/data/states_v1/`` (written by ``tests/statekit.py``) keeps states saved by 0.1.0, format 1:
a plain shuffled Loader, a Mix (with a schedule and a nested mixture), a Shards stream, and
``procpipe.torch.DataLoader`` over a map-style and an iterable dataset. Each file holds the state
taken after ``statekit.CUT`` batches and the batches that followed it. Today's code must (1) after
loading the saved state, yield exactly the saved batches (the promise); (2) take the very same
state at the same point (the format is unchanged, key for key: a change of it must raise the
version, keep loading format 1, and add a ``states_v2/`` beside these files); (3) refuse the saved
state with its version raised, as it would one from a newer procpipe.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import statekit

from procpipe import Loader

CASES = [pytest.param(c, marks=[pytest.mark.skipif(c.startswith("torch") and not statekit.HAVE_TORCH,
                                                   reason="torch is not installed")]) for c in statekit.CASES]


def saved(case: str) -> dict:
    return json.loads((statekit.DATA / f"{case}.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_a_saved_state_resumes_exactly(case):
    file = saved(case)
    assert statekit.resume(case, file["state"]) == file["rest"]


@pytest.mark.parametrize("case", CASES)
def test_the_state_taken_today_is_the_saved_one(case):
    file = saved(case)
    state, rest = statekit.cut(case)
    assert state == file["state"]
    assert rest == file["rest"]


@pytest.mark.parametrize("case", CASES)
def test_a_state_of_an_unknown_format_is_refused(case):
    state = saved(case)["state"]
    versioned = state["procpipe"] if case.startswith("torch") else state  # the facade's own entry
    assert versioned["version"] == 1
    versioned["version"] = 2
    loader = statekit.make_loader(case)
    try:
        with pytest.raises(ValueError, match="not a procpipe"):
            loader.load_state_dict(state)
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()


N, BS = 40, 4


def eight(i):
    return np.full(8, i, np.int64)  # 64 bytes a sample: a cache field with no padding


@pytest.mark.parametrize("change", [
    {"done_below": 10**10},  # would build a set of 10**10 positions
    {"done_below": 15},  # past the epoch's 10 batches: silently an empty epoch
    {"done_below": 2, "done": [4, 10]},
    {"ahead": [[1, 11, []]]},
])
def test_positions_outside_the_epoch_in_a_saved_state_are_refused(change):
    with Loader(list(range(N)), eight, batch_size=BS, workers=0, epochs=None) as loader:
        assert len(loader) == 10
        state = dict(loader.state_dict(), **change)
        with pytest.raises(ValueError, match="out of range.*10 batches"):
            loader.load_state_dict(state)
        loader.load_state_dict(dict(loader.state_dict(), done_below=10))  # the whole epoch done: fine
