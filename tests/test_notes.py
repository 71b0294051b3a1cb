"""_core/notes.py: `add_note` works on Python 3.10, where `BaseException.add_note` does not exist."""
from __future__ import annotations

import pickle
import sys

import pytest

from procpipe._core import notes

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)


class _Structured(Exception):
    """An exception whose args are structured and whose __init__ takes other arguments."""

    def __init__(self, code: int, *, where: str) -> None:
        super().__init__(code, where)
        self.code, self.where = code, where

    def __reduce__(self):
        return (_rebuild, (self.code, self.where, self.__dict__))


def _rebuild(code, where, state):
    exc = _Structured(code, where=where)
    exc.__dict__.update(state)
    return exc


def test_the_310_fallback_fills_notes_and_leaves_the_exception_alone():
    exc = OSError(2, "No such file")
    notes._add_note_by_attribute(exc, "procpipe: first")
    notes._add_note_by_attribute(exc, "procpipe: second")
    assert exc.__notes__ == ["procpipe: first", "procpipe: second"]
    assert exc.args == (2, "No such file") and exc.errno == 2 and str(exc) == "[Errno 2] No such file"
    # the notes cross a process boundary with the exception (pickle), as on 3.11
    back = pickle.loads(pickle.dumps(exc))
    assert back.__notes__ == ["procpipe: first", "procpipe: second"] and back.args == exc.args
    structured = _Structured(7, where="shard 3")
    notes._add_note_by_attribute(structured, "procpipe: third")
    back = pickle.loads(pickle.dumps(structured))
    assert (back.code, back.where, back.__notes__) == (7, "shard 3", ["procpipe: third"])


def test_the_310_fallback_checks_like_add_note():
    with pytest.raises(TypeError, match="must be a str"):
        notes._add_note_by_attribute(ValueError("x"), 3)  # type: ignore[arg-type]  # the check under test
    exc = ValueError("x")
    exc.__notes__ = ("not", "a list")  # type: ignore[attr-defined]  # a broken __notes__ under test
    with pytest.raises(TypeError, match="not a list"):
        notes._add_note_by_attribute(exc, "n")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="BaseException.add_note is Python 3.11+")
def test_add_note_agrees_with_the_fallback_on_311():
    native, fallback = KeyError("k"), KeyError("k")
    native.add_note("a")
    notes.add_note(native, "b")
    for note in ("a", "b"):
        notes._add_note_by_attribute(fallback, note)
    assert native.__notes__ == fallback.__notes__ == ["a", "b"]
