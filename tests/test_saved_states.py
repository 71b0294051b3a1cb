"""States saved by the format-1 code (``tests/data/states_v1/``, written by ``tests/statekit.py``)
load and resume exactly: a plain shuffled Loader, a Mix (with a schedule and a nested mixture),
a Shards stream, and ``procpipe.torch.DataLoader`` over a map-style and an iterable dataset.

Each file holds the state taken after ``statekit.CUT`` batches and the batches that followed it.
Today's code must (1) take the very same state at the same point (the format is unchanged, key
for key) and (2) after loading the saved state, yield exactly the saved batches.
"""
from __future__ import annotations

import json

import pytest
import statekit

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
