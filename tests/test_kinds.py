"""The source kind, resolved once (procpipe/_sources/resolve.py), and the one per-sample pipeline
(procpipe/_worker/stages.py) that indexed sources and streams share. All with ``workers=0``:
what is checked is which objects the Loader holds and what each sample goes through."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import procpipe
from procpipe.config import LoaderConfig
from procpipe._sources.indexed.index_kind import IndexedKind
from procpipe._sources.indexed.index_order import IndexOrder
from procpipe._sources.indexed.index_plan import IndexPlan
from procpipe._sources.mix.mix_kind import Mixing, MixKind, MixStreamKind
from procpipe._sources.resolve import kind_of, resolve_kind
from procpipe._sources.sample_names import IndexNames, RecordNames
from procpipe._sources.stream import ShardPlan, ShardProducer
from procpipe._sources.stream.stream_kind import StreamKind
from procpipe._worker.index_producer import IndexProducer
from procpipe._worker.worker_spec import GROWING, PER_INDEX, PER_RECORD

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)

OPTIONS = {"batch_size": 2}


def config(**options):
    return LoaderConfig.from_arguments(**{**OPTIONS, **options})


def open_shard(shard):
    return (np.int64(100 * shard + r) for r in range(3))


def shards(lengths=True):
    return procpipe.Shards([0, 1], open_shard, lengths=[3, 3] if lengths else None)


@pytest.mark.parametrize("name", ["indexed", "mix", "shards", "mix of shards", "growing"])
def test_each_source_kind_answers_plan_reader_driver_and_cache_layout(name: str) -> None:
    source = {
        "indexed": list(range(5)),
        "mix": procpipe.Mix([list(range(5)), list(range(3))], [1, 1]),
        "shards": shards(),
        "mix of shards": procpipe.Mix([shards(), shards()], [1, 1]),
        "growing": shards(lengths=False),
    }[name]
    kind = resolve_kind(source, config())
    streaming = name in ("shards", "mix of shards", "growing")
    assert type(kind) is {"indexed": IndexedKind, "mix": MixKind, "shards": StreamKind,
                          "mix of shards": MixStreamKind, "growing": StreamKind}[name]
    assert isinstance(kind, StreamKind) is streaming
    assert kind.order.epoch_plan is (ShardPlan if streaming else IndexPlan)
    assert isinstance(kind.names, RecordNames if streaming else IndexNames)
    assert isinstance(kind, Mixing) is name.startswith("mix")
    if streaming:  # the order's ShardProducer (a copy of the Shards) reads the blocks; the source is the Shards
        assert isinstance(kind.producer, ShardProducer)
        assert kind.producer is kind.order.producer and kind.source is kind.order.shards  # type: ignore[attr-defined]
        assert kind.producer.shards is not kind.source and type(kind.producer.shards) is type(kind.source)
        if name in ("shards", "growing"):
            assert kind.source is source  # (the user's own object, never changed)
        assert kind.producer.cache_kind == (GROWING if name == "growing" else PER_RECORD)
    else:
        assert isinstance(kind.producer, IndexProducer) and kind.source is source
        assert kind.producer.cache_kind == PER_INDEX
    assert set(kind.settings()) >= {"batch_size", "shuffle", "seed", "drop_last", "shard", "reshuffle"}


def test_every_order_option_comes_from_the_loaders_configuration_groups() -> None:
    """The orders are built from ``loader.config``'s groups themselves (``ShardOrder.of``,
    ``IndexOrder.of``), not from a list of the Loader's arguments copied by hand: each keyword a stream
    order takes is filled, with the value the Loader was given."""
    from procpipe._sources.mix.mix_shards import MixShardOrder
    from procpipe._sources.stream import ShardOrder

    given = {"batch_size": 3, "shuffle": True, "seed": 7, "drop_last": True, "reshuffle": False, "shard": (1, 2),
             "shuffle_buffer": 5, "even_ranks": True, "on_error": "skip", "max_skipped": 4, "speculate": 2.0}
    groups = config(**given)
    options: dict = {}

    class Recorded(ShardOrder):
        def __init__(self, source, **keywords):  # noqa: D107 - records what .of() passes
            options.update(keywords)

    Recorded.of(shards(), groups.batching, groups.stages, groups.faults)
    for plan in (ShardOrder, MixShardOrder):
        keywords = {name for name, p in inspect.signature(plan).parameters.items()
                    if p.kind is p.KEYWORD_ONLY or (p.default is not p.empty and name != "source")}
        assert keywords <= set(options), f"{plan.__name__} takes {sorted(keywords - set(options))}, not filled"
    for name, value in given.items():
        assert options[name] == value, name
    kind = resolve_kind(shards(), groups)
    assert kind.order.batch_size == 3 and kind.order.shard == (1, 2)  # type: ignore[attr-defined]
    indexed = config(**{k: given[k] for k in ("batch_size", "shuffle", "seed", "drop_last", "reshuffle", "shard")})
    assert IndexOrder.of(10, indexed.batching) == IndexOrder(10, 3, True, 7, True, (1, 2), False)


def test_the_kind_is_chosen_in_one_place() -> None:
    """``kind_of``: the one type test; each kind then builds itself from the groups (``of``)."""
    assert kind_of(list(range(3)), config().batching) is IndexedKind
    assert kind_of(shards(), config().batching) is StreamKind
    assert kind_of(procpipe.Mix([[1], [2]], [1, 1]), config().batching) is MixKind
    assert kind_of(procpipe.Mix([shards(), shards()], [1, 1]), config().batching) is MixStreamKind
    assert kind_of(list(range(3)), config(batches=lambda epoch: [[0]]).batching).__name__ == "CallerKind"


def test_a_source_of_no_kind_is_refused_naming_what_it_lacks() -> None:
    with pytest.raises(TypeError, match="source must support len.*lacks __getitem__"):
        resolve_kind({1, 2, 3}, config())
    with pytest.raises(ValueError, match="shuffle_buffer applies to streaming sources"):
        resolve_kind([1, 2], config(shuffle_buffer=4))
    with pytest.raises(ValueError, match="a procpipe.Mix draws each epoch's order"):
        resolve_kind(procpipe.Mix([[1], [2]], [1, 1]), config(batches=lambda epoch: [[0]]))


def _state(source, **options):
    with procpipe.Loader(source, batch_size=2, workers=0, **options) as loader:
        next(iter(loader))
        return loader.state_dict()


def test_each_kind_refuses_a_state_saved_over_another_kind() -> None:
    """``check_saved_kind``, answered by each kind's class: positions (records or batch positions)
    first, then a mixture or not, each error naming both kinds."""
    mix = procpipe.Mix([list(range(6)), list(range(4))], [1, 1])
    mixed_streams = procpipe.Mix([shards(), shards()], [1, 1])
    cases = [
        (list(range(10)), _state(shards()), "over a streaming source .* reads an indexable source"),
        (shards(), _state(list(range(10))), "over an indexable source, .* reads a streaming source"),
        (list(range(10)), _state(mix), "over a procpipe.Mix, .* reads an indexable source"),
        (mix, _state(list(range(10))), "over an indexable source, .* reads a procpipe.Mix"),
        (mixed_streams, _state(shards()), "over an indexable source, .* reads a procpipe.Mix"),
        (shards(), _state(mixed_streams), "over a procpipe.Mix, .* reads an indexable source"),
    ]
    for source, state, message in cases:
        with procpipe.Loader(source, batch_size=2, workers=0) as loader:
            with pytest.raises(ValueError, match=message):
                loader.load_state_dict(state)


def test_a_combined_state_is_refused_by_a_loader_over_the_callers_batches() -> None:
    """``CallerKind``: a combined state (``procpipe.combine_states``) cannot split ``batches=`` anew."""
    combined = procpipe.combine_states([_state(list(range(8)))])
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]
    with procpipe.Loader(list(range(8)), batches=lambda epoch: batches, workers=0) as loader:
        with pytest.raises(ValueError, match="batches=..., which cannot be split anew"):
            loader.load_state_dict(combined)


def test_a_stream_record_that_becomes_none_is_refused_as_an_indexed_sample_is() -> None:
    """The one pipeline's check: before, a stream batched None records silently."""
    with pytest.raises(TypeError, match=r"fn returned None for index \(shard 0, record 0\)"):
        list(procpipe.Loader(shards(), lambda record: None, batch_size=2, workers=0))
    with pytest.raises(TypeError, match="fn returned None for index 0"):
        list(procpipe.Loader(list(range(4)), lambda x: None, batch_size=2, workers=0))


def draw(record):
    return np.int64(record) * 0 + np.int64(np.random.randint(1 << 30))


@pytest.mark.parametrize("stream", [False, True])
def test_the_cached_stage_draws_from_its_samples_own_seed_for_every_kind(stream: bool) -> None:
    """A cached ``fn`` sees the global generators seeded from its sample's epoch-0 seed, whichever
    epoch computes it (``SampleScope.own_seed``): for a stream too, since both kinds share the stages."""
    values = []
    for first_epoch in (0, 3):
        source = shards() if stream else list(range(6))
        with procpipe.Loader(source, draw, batch_size=2, workers=0, cache=True) as loader:
            loader.set_epoch(first_epoch)
            values.append(np.concatenate(list(loader)).tolist())
    assert values[0] == values[1]
    assert len(set(values[0])) > 1  # (the draws differ per sample)


def _fn_case(case):
    """``(fn, collate_fn, batched)`` of one case of the fn-only loop's equivalence test."""
    def raises(i):
        if i == 3:
            raise KeyError(f"no record {i}")
        return i * 2

    return {
        "no fn": (None, None, True),
        "fn": (lambda i: {"x": np.full(2, i), "id": str(i)}, None, True),
        "draws": (lambda i: int(procpipe.sample_rng().integers(1 << 30)) + i, None, True),
        "returns None": (lambda i: None if i == 4 else i, None, True),
        "None with collate_fn": (lambda i: None, list, True),
        "None unbatched": (lambda i: None, None, False),
        "raises": (raises, None, True),
    }[case]


def _outcome(run):
    try:
        return ("samples", repr(run()))
    except Exception as exc:
        return (type(exc).__name__, str(exc))


@pytest.mark.parametrize("case", ["no fn", "fn", "draws", "returns None", "None with collate_fn", "None unbatched",
                                  "raises"])
def test_the_fn_only_loop_gives_what_run_sample_gives(case) -> None:
    """``stages.run_indices`` skips the call per sample where ``fn`` is the only stage
    (``fn_only``): the samples, the random draws, the error for a None and an exception raised
    by ``fn`` (and the index the scope names when it fails) are those of ``run_sample`` per index."""
    from procpipe._core.rng import SampleScope
    from procpipe._worker.stages import SKIPPED, fn_only, run_indices, run_sample
    from procpipe._worker.worker_spec import WorkerSpec

    fn, collate_fn, batched = _fn_case(case)
    spec = WorkerSpec(source=list(range(6)), producer=IndexProducer(list(range(6))), fn=fn, collate_fn=collate_fn,
                      batched=batched, seed=5)
    indices = [5, 1, 0, 3, 4, 2]

    def each(scope):
        samples = []
        for index in indices:
            scope.enter(2, index)
            sample = run_sample(spec, scope, index, spec.source, index, [])
            assert sample is not SKIPPED
            samples.append(sample)
        return samples

    scopes = [SampleScope(5, seed_globals="task"), SampleScope(5, seed_globals="task"), SampleScope(5, seed_globals="task")]
    status_fast = [0, -1]
    fast = _outcome(lambda: fn_only(spec, scopes[0], 2, indices, spec.source, status_fast))
    general = _outcome(lambda: each(scopes[1]))
    via = _outcome(lambda: run_indices(spec, scopes[2], 2, indices, None, [])[0])
    named = [scope.index for scope in scopes]  # (the sample being produced; a failing one's stays named)
    for scope in scopes:
        scope.leave()
    assert fast == general == via
    if fast[0] != "samples":
        assert named[0] == named[1] == named[2] == status_fast[1] in indices, "the scope names the failing index"
    assert (fast[0] == "samples") is (case in ("no fn", "fn", "draws", "None with collate_fn", "None unbatched"))


class _EpochTagged(procpipe.Shards):
    """A subclass on the hooks: its records carry the epoch ``reading`` said, its shards open through ``open_shard``."""

    def __init__(self) -> None:
        super().__init__([0, 1], open_shard, cycle_length=2, block_length=2, lengths=[3, 3])
        self.epoch = None  # per-process state, kept in the loader's copy only
        self.opened = 0  # (set, not mutated in place: the loader's copy is shallow)

    def open_shard(self, shard: int):
        self.opened += 1
        epoch = self.epoch
        return (int(record) + 1000 * epoch for record in super().open_shard(shard))

    def reading(self, epoch: int) -> None:
        self.epoch = epoch


def test_a_shards_subclass_reads_through_its_hooks_and_the_users_object_is_never_changed() -> None:
    source = _EpochTagged()
    before = dict(vars(source))
    with procpipe.Loader(source, batch_size=2, workers=0, epochs=2) as loader:
        records = sorted(int(r) for batch in loader for r in np.asarray(batch).ravel())
    assert records == sorted([*range(3), *range(100, 103), *range(1000, 1003), *range(1100, 1103)])
    assert vars(source) == before and source.epoch is None and source.opened == 0
    producer = resolve_kind(source, config()).producer
    assert producer.shards is not source and type(producer.shards) is _EpochTagged
