"""The user's classes come back from the workers as the very class objects (procpipe/_core/classref.py).

pickle names a class by ``module.__qualname__``; a class made by a factory inside another class
(``Outer.Row = namedtuple("Row", ...)``) or the worker's by-value copy of a ``__main__`` class
is not found that way, and dill's by-value fallback made the consumer build a look-alike class.
Workers started by forkserver or spawn do not import the main script: they hold dill's copies of
its classes, which go back by name and are looked up in the consumer's ``__main__``.
"""
from __future__ import annotations

import dataclasses
import pickle
import sys
import textwrap
from collections import namedtuple

import numpy as np
import pytest
from conftest import run_python

from procpipe import Loader
from procpipe._core import classref


class Holder:
    Row = namedtuple("Row", ["a", "b"])  # __qualname__ is "Row": pickle cannot find it

    @dataclasses.dataclass
    class Pair:
        x: np.ndarray
        n: int


def as_row(i: int) -> Holder.Row:
    return Holder.Row(np.full(2, i), i)


def to_pair(samples: list) -> Holder.Pair:
    return Holder.Pair(np.stack([s.a for s in samples]), len(samples))


def test_a_class_inside_a_class_pickles_by_reference():
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(Holder.Row)
    assert pickle.loads(classref.dumps(Holder.Row)) is Holder.Row
    assert pickle.loads(classref.dumps([Holder.Row(1, 2), Holder.Pair])) == [Holder.Row(1, 2), Holder.Pair]
    assert type(pickle.loads(classref.dumps(Holder.Row(1, 2)))) is Holder.Row
    Local = namedtuple("Local", "x")  # nowhere to be found: still travels, by value
    assert pickle.loads(classref.dumps(Local(3))).x == 3
    assert pickle.loads(classref.dumps(lambda: 5))() == 5  # dill's fallback is kept


@pytest.mark.parametrize("kwargs", [dict(batch_size=2), dict(batch_size=None), dict(batch_size=2, collate_fn=to_pair)],
                         ids=["stacked", "unbatched", "collate_fn"])
def test_workers_return_the_users_own_classes(kwargs):
    with Loader(list(range(6)), as_row, workers=2, **kwargs) as loader:
        batches = list(loader)
    kind = Holder.Pair if "collate_fn" in kwargs else Holder.Row
    assert [type(b) for b in batches] == [kind] * len(batches)


SCRIPT = textwrap.dedent('''
    import dataclasses
    from collections import namedtuple
    import sys
    import numpy as np
    import procpipe

    @dataclasses.dataclass
    class Batch:
        x: np.ndarray

    class Outer:
        Row = namedtuple("Row", "a b")

    def collate(samples):
        return Batch(np.stack(samples))

    def row(i):
        return Outer.Row(np.full(2, i), i)

    if __name__ == "__main__":
        with procpipe.Loader(list(range(8)), np.asarray, batch_size=4, workers=2, collate_fn=collate,
                             start_method=sys.argv[1]) as loader:
            print("dataclass", all(type(b) is Batch for b in loader))
        for batch_size in (4, None):
            with procpipe.Loader(list(range(8)), row, batch_size=batch_size, workers=2,
                                 start_method=sys.argv[1]) as loader:
                print("namedtuple", batch_size, all(type(b) is Outer.Row for b in loader))
''')


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_classes_of_the_main_script_come_back_as_themselves(tmp_path, start_method):
    """With fork the workers hold the script's very classes; with forkserver and spawn they do
    not import the script and hold dill's copies. Either way what they send back must be
    the script's own classes."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    result = run_python([str(script), start_method], timeout=180, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["dataclass True", "namedtuple 4 True", "namedtuple None True"]


def test_a_copy_of_a_main_class_is_named_for_the_receivers_main(monkeypatch):
    """A class of module ``__main__`` that this process's ``__main__`` lacks (a worker's copy)
    unpickles as the receiver's class of that name, nested ones included; one the receiver
    lacks too still arrives, by value."""
    main = sys.modules["__main__"]
    Mine = type("PpMine", (), {"__module__": "__main__"})
    Outer = type("PpOuter", (), {"__module__": "__main__", "Row": namedtuple("PpRow", "a", module="__main__")})
    copy = type("PpMine", (), {"__module__": "__main__"})  # the worker's twins
    row_copy = namedtuple("PpRow", "a", module="__main__")
    alone = namedtuple("PpAlone", "a", module="__main__")  # nowhere in the receiver
    data = classref.dumps([copy, row_copy(1), alone(2)])
    monkeypatch.setattr(main, "PpMine", Mine, raising=False)
    monkeypatch.setattr(main, "PpOuter", Outer, raising=False)
    got = pickle.loads(data)
    assert got[0] is Mine and type(got[1]) is Outer.Row and got[1].a == 1
    assert type(got[2]).__name__ == "PpAlone" and got[2].a == 2
