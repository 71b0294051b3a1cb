"""``procpipe.torch.DataLoader.state_dict()`` / ``load_state_dict()``: torchdata's
``StatefulDataLoader`` contract (docs/guide/pytorch-resume.md).

One parametrized test takes a state at each point of an epoch (before the first batch,
mid-epoch, after the last batch, after ``StopIteration``) in one pass, and
resumes each in a new DataLoader: the rest of that epoch, then the next epoch, must be
the uninterrupted run's. Then the replica that survives a worker's death, and the
differences from StatefulDataLoader that are on purpose.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.utils.data as tud

from procpipe.torch import DataLoader
from procpipe.torch.iterable import ReplicaLostError


# ------------------------------------------------------------------ datasets, samplers
class Squares(tud.Dataset):
    def __init__(self, n: int = 22) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])


class Noisy(Squares):
    """Draws from torch's global generator in ``__getitem__``, keeps no state of its own."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(torch.randint(1000, (1,)))])


class StatefulNoisy(Noisy):
    def state_dict(self) -> dict:
        return {"calls": 1}

    def load_state_dict(self, state: dict) -> None:
        pass


class EpochSampler(tud.Sampler):
    """A Stateful sampler: its order depends on its own epoch counter, saved in its state."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.epoch)
        self.epoch += 1
        return iter(torch.randperm(self.n, generator=g).tolist())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]


class LcgIterator:
    """A Stateful iterator over ``range(start, stop, step)``, each value with a draw of its own generator."""

    def __init__(self, start: int, stop: int, step: int) -> None:
        self.i, self.stop, self.step, self.x = start, stop, step, start + 1

    def __iter__(self) -> LcgIterator:
        return self

    def __next__(self) -> int:
        if self.i >= self.stop:
            raise StopIteration
        self.x = (self.x * 6364136223846793005 + 1442695040888963407) % 2**64
        value = self.i * 1000 + self.x % 1000
        self.i += self.step
        return value

    def state_dict(self) -> dict:
        return {"i": self.i, "x": self.x}

    def load_state_dict(self, state: dict) -> None:
        self.i, self.x = state["i"], state["x"]


def _shard() -> tuple[int, int]:
    info = tud.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class Stream(tud.IterableDataset):
    """Sharded by worker; its iterator is Stateful. ``die_at``: worker 1's iterator ends its
    process once (a marker file says it did) when it reaches that value."""

    def __init__(self, n: int = 23, die_at: int | None = None, marker: str = "") -> None:
        self.n, self.die_at, self.marker = n, die_at, marker

    def __iter__(self):
        w, k = _shard()
        it = LcgIterator(w, self.n, k)
        if self.die_at is None or w != 1:
            return it
        return _Dying(it, self.die_at, self.marker)


class _Dying(LcgIterator):
    def __init__(self, it: LcgIterator, die_at: int, marker: str) -> None:
        self.__dict__.update(it.__dict__)
        self.die_at, self.marker = die_at, marker

    def __next__(self) -> int:
        if self.i == self.die_at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(3)
        return super().__next__()


class PlainStream(tud.IterableDataset):
    """Not Stateful at all: a resume makes the replica's first batches again and drops them."""

    def __iter__(self):
        w, k = _shard()
        yield from range(w, 23, k)


# ------------------------------------------------------------------ the resume matrix
def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(7)


CASES = {
    "map": lambda: DataLoader(Squares(), batch_size=4, num_workers=2),
    "map-inline": lambda: DataLoader(Squares(), batch_size=4),
    "map-shuffle-global-inline": lambda: DataLoader(Squares(), batch_size=3, shuffle=True),
    "map-stateful-sampler": lambda: DataLoader(Squares(), batch_size=4, sampler=EpochSampler(22), num_workers=2),
    "map-batch-sampler": lambda: DataLoader(Squares(), num_workers=2, batch_sampler=tud.BatchSampler(
        tud.RandomSampler(range(22), generator=_generator()), 3, drop_last=True)),
    "map-unbatched": lambda: DataLoader(Squares(), batch_size=None, shuffle=True, generator=_generator(),
                                        num_workers=2),
    "map-persistent": lambda: DataLoader(Squares(), batch_size=4, shuffle=True, generator=_generator(),
                                         num_workers=2, persistent_workers=True),
    "map-unordered": lambda: DataLoader(Squares(), batch_size=2, num_workers=2, in_order=False),
    # (random samples resume exactly with procpipe's per-batch seeds: seed_globals=True)
    "map-forkserver": lambda: DataLoader(Noisy(), batch_size=4, num_workers=2, multiprocessing_context="forkserver",
                                         seed_globals=True),
    "iterable": lambda: DataLoader(Stream(), batch_size=2, num_workers=2),
    "iterable-inline": lambda: DataLoader(Stream(), batch_size=2),
    "iterable-not-stateful": lambda: DataLoader(PlainStream(), batch_size=2, num_workers=2),
    "iterable-persistent-every-3": lambda: DataLoader(Stream(), batch_size=2, num_workers=2, persistent_workers=True,
                                                      snapshot_every_n_steps=3),
}


# Where each case's states are resumed from (cost: each resume starts workers for two epochs).
# Every case resumes mid-epoch; the cheap inline cases, the reference cases ("map",
# "iterable") and the Stateful sampler (its epoch counter moves when an epoch starts and
# ends) resume from all four points; the others from the points where their own feature
# keeps state: a generator or persistent workers across the end of an epoch, batches in
# flight (unordered, a replica's snapshots) inside one. The pairs that found bugs stay:
# an iterable's ended epoch, a finished state's sampler generators and Stateful sampler,
# an ordered stream resumed mid-epoch.
ALL_POINTS = (0, 5, "last", "ended")
POINTS = {
    "map": ALL_POINTS,
    "map-inline": ALL_POINTS,
    "map-shuffle-global-inline": ALL_POINTS,
    "map-stateful-sampler": ALL_POINTS,
    "map-batch-sampler": (0, 5, "ended"),
    "map-unbatched": (5, "last"),
    "map-persistent": (5, "ended"),
    "map-unordered": (5, "last"),
    "map-forkserver": (5, "ended"),
    "iterable": ALL_POINTS,
    "iterable-inline": ALL_POINTS,
    "iterable-not-stateful": (0, 5, "ended"),
    "iterable-persistent-every-3": (5, "last", "ended"),
}


def test_every_point_is_resumed_in_map_and_iterable_cases_with_and_without_workers():
    """The trimmed matrix still crosses each point with both source kinds, with and without workers."""
    assert set(POINTS) == set(CASES)
    for point in ALL_POINTS:
        cases = [c for c, points in POINTS.items() if point in points]
        assert {c.split("-")[0] for c in cases} == {"map", "iterable"}, point
        assert any("inline" in c for c in cases) and any("inline" not in c for c in cases), point


def _plain(batch) -> list:
    return batch.tolist() if isinstance(batch, torch.Tensor) else [_plain(b) for b in batch]


def _same(case: str, got: list, want: list) -> None:
    if case.endswith("unordered"):  # as they finish: each batch exactly once, in any order
        assert sorted(got) == sorted(want) and len(got) == len(want)
    else:
        assert got == want


@pytest.mark.filterwarnings("ignore:.*neither the IterableDataset nor its iterator is Stateful")
@pytest.mark.parametrize("case", list(CASES))
def test_a_state_taken_anywhere_in_an_epoch_resumes_to_the_next_batch(case):
    """States taken before the first batch, mid-epoch, after the last batch (before
    StopIteration) and after StopIteration (those of ``POINTS[case]``): each, loaded into a new DataLoader (through JSON),
    gives the rest of that epoch, then the next epoch, as the uninterrupted run."""
    loader = CASES[case]()
    it = iter(loader)
    states = {0: loader.state_dict()}
    epoch0: list = []
    for batch in it:
        epoch0.append(_plain(batch))
        if len(epoch0) == 5:
            states[len(epoch0)] = loader.state_dict()
        states["last"] = loader.state_dict()
    states["ended"] = loader.state_dict()
    epoch1 = [_plain(b) for b in loader]
    loader.close()
    assert len(epoch0) > 5
    for point, state in states.items():
        if point not in POINTS[case]:
            continue
        before = len(epoch0) if point in ("last", "ended") else point
        resumed = CASES[case]()
        resumed.load_state_dict(json.loads(json.dumps(state)))
        rest = [] if point == "ended" else [_plain(b) for b in resumed]
        _same(case, epoch0[:before] + rest, epoch0)
        _same(case, [_plain(b) for b in resumed], epoch1)
        resumed.close()


# ------------------------------------------------------------------ a replica survives its worker's death
@pytest.mark.parametrize("every", [1, 3])
def test_a_stateful_replica_survives_its_workers_death_exactly_once(tmp_path, every):
    """Worker 1 dies mid-epoch (os._exit); its replacement restores the replica from its
    last snapshot (every ``every`` batches) and makes again only the batches between:
    the epoch is the uninterrupted one, every batch once, in order (torch: the loader fails)."""
    want = [_plain(b) for b in DataLoader(Stream(), batch_size=2, num_workers=2)]
    marker = tmp_path / "died"
    loader = DataLoader(Stream(die_at=13, marker=str(marker)), batch_size=2, num_workers=2,
                        snapshot_every_n_steps=every, multiprocessing_context="fork")
    assert [_plain(b) for b in loader] == want
    assert marker.exists()
    loader.close()


def test_a_replica_without_state_still_fails_on_its_workers_death():
    """Nothing Stateful: the replica cannot be resumed in another process (ReplicaLostError)."""

    class Dies(PlainStream):
        def __iter__(self):
            w, k = _shard()
            for v in range(w, 23, k):
                if w == 1 and v > 6:
                    os._exit(3)
                yield v

    with pytest.raises(ReplicaLostError, match="neither the dataset nor its iterator is Stateful"):
        list(DataLoader(Dies(), batch_size=2, num_workers=2, max_worker_restarts=1))


# ------------------------------------------------------------------ differences on purpose
def test_map_samples_come_from_per_sample_seeds_so_any_num_workers_resumes():
    """Differences from StatefulDataLoader, with ``seed_globals=True``: a map-style sample's
    randomness comes from (seed, epoch, index), not from the dataset's state, so a dataset drawing from torch's
    generator resumes exactly without being Stateful; and the position is in batches of the
    epoch, not per worker, so a state resumes with another ``num_workers`` (torchdata
    raises AssertionError)."""
    loader = DataLoader(Noisy(), batch_size=4, num_workers=2, seed_globals=True)
    it = iter(loader)
    head = [_plain(next(it)) for _ in range(2)]
    state = loader.state_dict()
    want = head + [_plain(b) for b in it]
    again = DataLoader(Noisy(), batch_size=4, num_workers=1, generator=torch.Generator().manual_seed(99),
                       seed_globals=True)
    again.load_state_dict(state)  # the saved per-sample seed is used, not this generator's
    assert head + [_plain(b) for b in again] == want


class GlobalDraws(tud.Dataset):
    """Draws from torch's global generator in ``__getitem__`` and saves it in its state (as torchdata's
    ``DummyMapDataset(shuffle=True)``): exact resume needs each worker's own generator back."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        return i * 1000 + int(torch.randint(1000, (1,)).item())

    def state_dict(self) -> dict:
        return {"rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["rng"])


@pytest.mark.parametrize("workers", [3, 4])
@pytest.mark.parametrize("persistent", [False, True])
def test_map_workers_resume_their_dataset_state_with_torchs_seeds(workers, persistent):
    """A Stateful map-style dataset's state is taken in each worker after each batch (torchdata's
    worker snapshots): with torch's worker seeds (the default), a resumed epoch draws exactly what the
    original drew, and each worker_<i> reports the state of its last batch returned."""
    kwargs = dict(batch_size=2, num_workers=workers, persistent_workers=persistent,
                  generator=torch.Generator().manual_seed(3))
    loader = DataLoader(GlobalDraws(), **kwargs)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    rest = [b.tolist() for b in it]
    snapshots = state["_snapshot"]["_worker_snapshots"]
    assert all(snapshots[f"worker_{w}"]["dataset_state"] is not None for w in range(workers))
    again = DataLoader(GlobalDraws(), **kwargs)
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == rest
    loader.close()
    again.close()


def test_map_dataset_state_with_num_workers_0_is_the_datasets():
    inline = DataLoader(StatefulNoisy(), batch_size=4)
    next(iter(inline))
    assert inline.state_dict()["dataset_state"] == {"calls": 1}


def test_a_replica_reports_its_initial_state_before_its_first_batch():
    """As torchdata's: a state taken right after ``iter()`` holds each replica's initial state (the
    state waits for the replicas to start; the DataLoader holds its latest iterator, so a dropped
    ``iter(loader)`` still runs), and resuming from it yields the same batches."""
    loader = DataLoader(Stream(), batch_size=2, num_workers=2)
    it = iter(loader)
    state = loader.state_dict()
    for s in state["_snapshot"]["_worker_snapshots"].values():
        assert s["dataset_state"] is not None or s["fetcher_state"]["dataset_iter_state"] is not None
    want = [_plain(b) for b in it]
    again = DataLoader(Stream(), batch_size=2, num_workers=2)
    again.load_state_dict(state)
    assert [_plain(b) for b in again] == want
    loader.close()
    again.close()


def test_an_iterable_state_needs_the_same_num_workers():
    loader = DataLoader(Stream(), batch_size=2, num_workers=2)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(ValueError, match="num_workers=2, but this one has num_workers=1"):
        DataLoader(Stream(), batch_size=2, num_workers=1).load_state_dict(state)
    with pytest.raises(ValueError, match="over an IterableDataset, but this one reads a map-style"):
        DataLoader(Squares(), batch_size=2).load_state_dict(state)
    loader.close()


def test_state_dict_after_load_is_the_loaded_state():
    loader = DataLoader(Squares(), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    again = DataLoader(Squares(), batch_size=4, num_workers=2)
    again.load_state_dict(state)
    assert again.state_dict() == state
    loader.close()


def test_snapshot_every_n_steps_is_checked():
    with pytest.raises(ValueError, match="snapshot_every_n_steps must be an int >= 0"):
        DataLoader(Stream(), snapshot_every_n_steps=-1)


# ------------------------------------------------------------------ issue 21, item 5
class ForgetsReturn(Squares):
    def __getitem__(self, i: int):
        if i == 37:
            return None
        return torch.zeros(2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sample_that_is_none_names_the_index_and_the_forgotten_return(num_workers):
    loader = DataLoader(ForgetsReturn(64), batch_size=8, num_workers=num_workers)
    with pytest.raises(TypeError, match=r"returned None for index 37.*forget a `return`") as caught:
        list(loader)
    assert "_Leaf" not in str(caught.value)
    loader.close()


@pytest.mark.parametrize("make", [lambda: DataLoader(Squares(), batch_size=4, num_workers=2),
                                  lambda: DataLoader(Stream(), batch_size=2, num_workers=2)], ids=["map", "iterable"])
def test_a_state_taken_after_the_loop_broke_off(make):
    """``for batch in loader: ... break`` drops the iterator (its workers end, without
    persistent_workers); ``state_dict()`` afterwards still resumes after the last batch."""
    want = [_plain(b) for b in make()]
    loader, got = make(), []
    for batch in loader:
        got.append(_plain(batch))
        if len(got) == 3:
            break
    state = loader.state_dict()
    again = make()
    again.load_state_dict(state)
    assert got + [_plain(b) for b in again] == want


# ------------------------------------------------------------------ issue 44: the state's schema
def _has_keys_of(part: dict, typed: type) -> None:
    """``part``'s keys are the ``TypedDict``'s: every required one, no other than its optional ones."""
    required, optional = typed.__required_keys__, typed.__optional_keys__
    assert required <= part.keys() <= required | optional, (typed.__name__, sorted(part))


def _check_schema(state: dict) -> None:
    """``state`` (a ``state_dict()``) is laid out as ``procpipe.torch.state_schema`` says, part by part."""
    from procpipe.torch import state_schema as schema

    entry = state[schema.PROCPIPE]
    _has_keys_of(entry, schema.FacadeEntry)
    assert entry[schema.VERSION_KEY] == schema.VERSION
    if schema.DRAW in entry:
        _has_keys_of(entry[schema.DRAW], schema.Draw)
    replica_states = [s for _, _, s in entry.get(schema.REPLICAS, {}).values() if s is not None]
    if schema.IN_PROCESS in entry:
        replica_states.append(entry[schema.IN_PROCESS])
    for replica in replica_states:
        _has_keys_of(replica, schema.ReplicaState)
        _has_keys_of(replica[schema.FETCHER_STATE], schema.FetcherState)
    if schema.SNAPSHOT in state:
        assert state.keys() == {schema.SNAPSHOT, schema.PROCPIPE}
        _has_keys_of(state[schema.SNAPSHOT], schema.Snapshot)
        _has_keys_of(state[schema.SNAPSHOT][schema.MAIN_SNAPSHOT], schema.MainSnapshot)
        workers = state[schema.SNAPSHOT][schema.WORKER_SNAPSHOTS]
        assert len(workers) == entry[schema.NUM_WORKERS]
        for key, worker in workers.items():
            _has_keys_of(worker, schema.WorkerSnapshot)
            assert key == schema.worker_key(worker[schema.WORKER_ID])
            assert schema.worker_of_key(key) == worker[schema.WORKER_ID]
            if worker[schema.FETCHER_STATE] is not None:
                _has_keys_of(worker[schema.FETCHER_STATE], schema.FetcherState)
    else:
        assert state.keys() == {schema.DATASET_STATE, schema.FETCHER_STATE, schema.ITERATOR_FINISHED, schema.PROCPIPE}
        if state[schema.FETCHER_STATE] is not None:
            _has_keys_of(state[schema.FETCHER_STATE], schema.FetcherState)


@pytest.mark.unit
@pytest.mark.parametrize("case", ["torch_map", "torch_iterable"])
def test_the_saved_v1_states_are_laid_out_as_the_schema_says(case):
    """The TypedDicts of ``procpipe.torch.state_schema`` describe the states 0.1.0 saved."""
    from pathlib import Path

    _check_schema(json.loads((Path(__file__).parent / "data" / "states_v1" / f"{case}.json").read_text())["state"])


@pytest.mark.parametrize("make", [
    lambda: DataLoader(StatefulNoisy(), batch_size=4, sampler=EpochSampler(22), num_workers=2),
    lambda: DataLoader(StatefulNoisy(), batch_size=4, shuffle=True, generator=_generator()),
    lambda: DataLoader(Stream(), batch_size=2, num_workers=2),
    lambda: DataLoader(Stream(), batch_size=2),
], ids=["map", "map-inline", "iterable", "iterable-inline"])
def test_every_state_is_laid_out_as_the_schema_says(make):
    """Before, during and after an epoch, and loaded back: each part of the state has the keys of its
    ``TypedDict`` (what mypy checks ``procpipe.torch.state`` against is what it really stores)."""
    loader = make()
    states = [loader.state_dict()]
    it = iter(loader)
    next(it)
    states.append(loader.state_dict())
    for _ in it:
        pass
    states.append(loader.state_dict())
    for state in states:
        _check_schema(state)
    again = make()
    again.load_state_dict(states[1])
    assert again.state_dict() == states[1]
    next(iter(again))
    _check_schema(again.state_dict())
    loader.close()
    again.close()
