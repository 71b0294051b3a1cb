"""``workers=0``: one driver (procpipe/_consumer/inline.py ``InlineDriver``) for every source kind, driving
the engine's own epochs and plans in the calling thread. What each kind keeps (errors, skips,
positions, resume, seeding) is checked where the feature is tested; here: that every kind runs on
the one driver, and what the driver gives every kind alike."""

from __future__ import annotations

import numpy as np
import pytest

import procpipe
from procpipe._consumer.inline import InlineDriver

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)


def open_shard(shard):
    return (np.int64(100 * shard + r) for r in range(5))


SOURCES = {
    "indexed": lambda: list(range(10)),
    "mix": lambda: procpipe.Mix([list(range(6)), list(range(4))], [1, 1]),
    "shards": lambda: procpipe.Shards([0, 1], open_shard, lengths=[5, 5]),
    "mix of shards": lambda: procpipe.Mix(
        [procpipe.Shards([0, 1], open_shard, lengths=[5, 5]), procpipe.Shards([2], open_shard, lengths=[5])], [1, 1]
    ),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_every_kind_runs_on_the_one_driver_and_counts_its_bytes(name: str) -> None:
    """Before, a stream's ``workers=0`` iterator left ``stats()["bytes"]`` at 0."""
    with procpipe.Loader(SOURCES[name](), batch_size=3, workers=0) as loader:
        it = iter(loader)
        assert type(it) is InlineDriver
        total = sum(np.asarray(batch).nbytes for batch in it)
        stats = loader.stats()
    assert total > 0 and stats["bytes"] == total, (total, stats["bytes"])


class Interrupt(BaseException):
    """Stands for a KeyboardInterrupt raised inside the user's fn."""


def interrupt_at_4(x):
    if int(x) % 100 == 4:
        raise Interrupt("stop")
    return x


@pytest.mark.parametrize("name", ["indexed", "shards"])
def test_an_interrupt_ends_the_iteration_and_later_next_calls_say_so(name: str) -> None:
    """Before, an indexed iteration went on past the interrupted batch, and a stream's next ``next()``
    raised StopIteration, as if the epoch had ended normally. Each thread is told once (issue 43: a
    loop that catches and calls next() again must not spin): the one that met the interrupt by it,
    another by a RuntimeError from it; then the iteration is over."""
    import threading

    source = list(range(10)) if name == "indexed" else procpipe.Shards([0], open_shard, lengths=[5])
    with procpipe.Loader(source, interrupt_at_4, batch_size=2, workers=0) as loader:
        it = iter(loader)
        assert [int(v) for v in next(it)] == [0, 1] and [int(v) for v in next(it)] == [2, 3]
        with pytest.raises(Interrupt):
            next(it)
        seen: list[BaseException] = []

        def other_thread() -> None:
            for _ in range(2):
                try:
                    next(it)
                except BaseException as exc:  # noqa: BLE001 - what each next() raised, checked below
                    seen.append(exc)

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(30)
        assert [type(e) for e in seen] == [RuntimeError, StopIteration], seen
        assert "already ended with an error" in str(seen[0]) and isinstance(seen[0].__cause__, Interrupt)
        with pytest.raises(StopIteration):  # (this thread met the interrupt itself)
            next(it)
        assert not loader.stats()["running"]
