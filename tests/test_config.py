"""The configuration object: ``Loader``'s arguments in frozen, checked groups (``loader.config``).

What is checked here: the groups are frozen and slotted; ``repr`` shows the whole
configuration, a group per line; every ``Loader`` argument belongs to exactly one group, with
the same default; each argument is checked in one place (its group's ``__post_init__``, or
``check_across`` for the rules spanning groups); the internals are given slices (the engine's
``EngineConfig``, keyword-only; ``WorkerSpec.of``). Everything runs with ``workers=0`` or no
Loader at all: no process is started.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path

import pytest

from procpipe import AutoWorkers, Loader
from procpipe.config import ARGUMENT_GROUPS, DEFAULT_WORKER_ENV, Execution, LoaderConfig, engine_config
from procpipe.config import Batching, Device, Faults, Memory, Stages
from procpipe.config import EngineConfig
from procpipe._worker.index_producer import IndexProducer
from procpipe._worker.worker_spec import WorkerSpec

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)

CONFIG_MODULES = ("config.py",)  # where LoaderConfig and its groups check their arguments


def double(x):
    return 2 * x


def test_loader_config_is_frozen_and_slotted():
    with Loader(list(range(8)), double, batch_size=4, workers=0, shuffle=True, seed=3) as loader:
        config = loader.config
        assert isinstance(config, LoaderConfig)
        assert config.batching.batch_size == 4 and config.batching.seed == 3 and config.stages.fn is double
        with pytest.raises(dataclasses.FrozenInstanceError):
            config.batching.batch_size = 8  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            config.faults = Faults()  # type: ignore[misc]
        with pytest.raises(AttributeError):
            loader.config = config  # type: ignore[misc]  # read-only: no setter
        for group in (config, *(getattr(config, f.name) for f in dataclasses.fields(config))):
            assert not hasattr(group, "__dict__"), f"{type(group).__name__} has no __slots__"
        assert [b.tolist() for b in loader] and loader.config is config  # iterating changes nothing


def test_repr_shows_the_whole_configuration_a_group_per_line():
    with Loader(list(range(8)), double, batch_size=4, workers=0, shard=[1, 2], on_error="skip") as loader:
        text = repr(loader.config)
    lines = text.splitlines()
    assert lines[0] == "LoaderConfig(" and lines[-1] == ")"
    groups = [line.strip().split("=", 1)[0] for line in lines[1:-1]]
    assert groups == ["batching", "stages", "execution", "memory", "faults", "device"]
    for name in ARGUMENT_GROUPS:  # every argument is shown, in its group's line
        line = next(line for line in lines if line.strip().startswith(ARGUMENT_GROUPS[name] + "="))
        assert f"{name}=" in line, (name, line)
    assert f"fn={__name__}.double," in text  # a function by its name, not its address
    assert "shard=(1, 2)" in text and "on_error='skip'" in text
    assert repr(Faults(task_timeout=2.5)) == (
        "Faults(on_error='raise', max_skipped=0.01, task_timeout=2.5, speculate=None, max_worker_restarts=3)"
    )


def test_every_loader_argument_is_in_one_group_with_the_same_default():
    params = dict(inspect.signature(Loader.__init__).parameters)
    del params["self"], params["source"]
    assert set(params) == set(ARGUMENT_GROUPS), "Loader's arguments and the configuration's fields differ"
    owners: dict[str, list[str]] = {}
    for group in dataclasses.fields(LoaderConfig):
        for f in dataclasses.fields(group.default_factory()):  # type: ignore[misc]
            owners.setdefault(f.name, []).append(group.name)
            assert params[f.name].default == f.default, f"{group.name}.{f.name}: the default differs from Loader's"
    assert all(len(groups) == 1 for groups in owners.values()), owners


def test_loader_passes_each_argument_by_name_to_the_configuration():
    """``Loader.__init__`` names every argument it hands ``LoaderConfig.from_arguments`` (``name=name``),
    so a local variable added to ``__init__`` never becomes an argument by accident."""
    import ast
    import pathlib

    import procpipe.loader

    tree = ast.parse(pathlib.Path(procpipe.loader.__file__).read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    call = next(n for n in ast.walk(init) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "from_arguments")
    passed = {k.arg: k.value.id for k in call.keywords if isinstance(k.value, ast.Name)}
    assert not call.args and len(passed) == len(call.keywords), "every argument is passed as name=name"
    params = set(inspect.signature(Loader.__init__).parameters) - {"self", "source"}
    assert passed == {name: name for name in params}
    assert repr(LoaderConfig.from_arguments()) == repr(LoaderConfig())  # nothing passed: every default


BAD_ARGUMENTS = [
    ({"on_error": "ignore"}, ValueError, "on_error must be 'raise' or 'skip', got 'ignore'"),
    ({"max_skipped": 2.0}, ValueError, "max_skipped must be an int >= 0 (a count) or a float in [0, 1]"),
    ({"task_timeout": 0}, ValueError, "task_timeout must be None or a number of seconds > 0, got 0"),
    ({"speculate": 0.5}, ValueError, "speculate must be None or a number >= 1"),
    ({"max_worker_restarts": -1}, ValueError, "max_worker_restarts must be an int >= 0, got -1"),
    ({"fn": 3}, TypeError, "fn must be callable or None, got int"),
    ({"augment": "x"}, TypeError, "augment must be callable or None, got str"),
    ({"cache": 5}, TypeError, "cache must be None, False, True, 'memory' or a directory path, got int"),
    ({"seed_globals": "batch"}, ValueError, "seed_globals must be True"),
    ({"device_fn": double}, ValueError, "device_fn runs on batches once they are on a device"),
    ({"batch_size": 0}, ValueError, "batch_size must be an int >= 1 or None, got 0"),
    ({"seed": -1}, ValueError, "seed must be an int >= 0, got -1"),
    ({"shard": (2, 2)}, ValueError, "shard must be (rank, world_size) with 0 <= rank < world_size, got (2, 2)"),
    ({"epochs": 0}, ValueError, "epochs must be an int >= 1 or None (endless), got 0"),
    ({"with_epoch": 1}, TypeError, "with_epoch must be True or False, got 1"),
    ({"even_ranks": True}, ValueError, "even_ranks=True evens out the batches of the ranks of shard="),
    ({"batches": lambda e: [[0]], "shuffle": True}, ValueError, "shuffle, drop_last and shard do not apply"),
    ({"batches": lambda e: [[0]], "reshuffle": False}, ValueError, "reshuffle does not apply"),
    ({"shuffle_buffer": 0}, ValueError, "shuffle_buffer must be an int >= 1 or None, got 0"),
    ({"workers": "many"}, ValueError, "workers must be an int >= 0 or 'auto', got 'many'"),
    ({"workers": -1}, ValueError, "workers must be an int >= 0, got -1"),
    ({"prefetch": 0}, ValueError, "prefetch must be an int >= 1, got 0"),
    ({"start_method": "thread"}, ValueError, "start_method must be one of"),
    ({"backend": object()}, TypeError, "backend must be None or a procpipe.ray.Backend(...)"),
    ({"slot_bytes": 0}, ValueError, "slot_bytes must be an int >= 1 or None, got 0"),
    ({"shm_dir": "/no/such/dir"}, ValueError, "shm_dir='/no/such/dir' is not a writable directory"),
    ({"stage_slots": -1}, ValueError, "stage_slots must be an int >= 0, got -1"),
    ({"collate_fn": double, "batch_size": None}, ValueError, "collate_fn needs a batch_size"),
    ({"batch_fn": double, "batch_size": None}, ValueError, "batch_fn needs a batch_size"),
]


@pytest.mark.parametrize(("arguments", "error", "message"), BAD_ARGUMENTS,
                         ids=["-".join(arguments) for arguments, _, _ in BAD_ARGUMENTS])
def test_each_argument_is_checked_in_one_place(arguments, error, message):
    """The Loader's error is raised by the configuration (a group's ``__post_init__`` or the
    cross-group check), before anything starts, and ``LoaderConfig`` alone raises the same."""
    with pytest.raises(error) as raised:
        Loader(list(range(8)), **{"workers": 0, **arguments})
    assert message in str(raised.value)
    frames = [(str(Path(entry.path).resolve()), entry.name) for entry in raised.traceback]
    checked_by = [name for path, name in frames if any(path.endswith(module) for module in CONFIG_MODULES)]
    assert {"__post_init__", "check_across"} & set(checked_by), frames  # a group's check, or the cross-group one
    with pytest.raises(error) as again:
        LoaderConfig.from_arguments(**{"workers": 0, **arguments})
    assert str(again.value) == str(raised.value)


def test_a_group_is_valid_on_its_own_and_across_groups_once_composed():
    with pytest.raises(ValueError, match="on_error must be"):
        Faults(on_error="retry")
    with pytest.raises(ValueError, match="device_fn runs on batches once they are on a device"):
        Device(device_fn=double)
    with pytest.raises(TypeError):
        Batching(4)  # type: ignore[misc]  # keyword-only: no positional copies
    unbatched, collated = Batching(batch_size=None), Stages(collate_fn=double)  # each valid alone
    with pytest.raises(ValueError, match="collate_fn needs a batch_size"):
        LoaderConfig(batching=unbatched, stages=collated)
    with pytest.raises(TypeError, match="unexpected keyword argument 'batchsize'"):
        LoaderConfig.from_arguments(batchsize=4)


def test_arguments_are_kept_as_passed_but_never_shared():
    env = {"OMP_NUM_THREADS": "2"}
    with Loader(list(range(8)), workers=0, worker_env=env, shard=[0, 2]) as loader:
        env["OMP_NUM_THREADS"] = "8"  # the caller's dict changes later: the configuration does not
        assert loader.config.execution.worker_env == {"OMP_NUM_THREADS": "2"}
        assert loader.config.batching.shard == (0, 2)  # a list accepted, kept as a pair
        assert loader.config.execution.workers == 0 and loader.workers_setting == 0


def test_worker_env_must_map_names_to_strings():
    """A number in ``worker_env`` used to pass unchecked (and fail in the worker's start); now
    the Loader says so when it is created."""
    with pytest.raises(TypeError, match=r"worker_env must be a dict of environment variable names to str values"):
        Loader(list(range(8)), workers=0, worker_env={"OMP_NUM_THREADS": 2})
    with pytest.raises(TypeError, match=r"worker_env must be a dict"):
        Loader(list(range(8)), workers=0, worker_env=["OMP_NUM_THREADS=2"])


class FakeBackend:
    """What ``Execution`` asks of a backend: ``pool`` and ``lanes``."""

    nodes = 3

    def pool(self, *args):  # pragma: no cover - never started here
        raise AssertionError

    def lanes(self, workers):
        return self.nodes * workers


def test_the_engine_gets_its_slice_keyword_only():
    config = LoaderConfig.from_arguments(
        workers=3, worker_env={"A": "1"}, prefetch=4, slot_bytes=4096, stage_slots=1, speculate=2.0
    )
    engine = engine_config(config, "forkserver", device_slots=2)
    assert engine == EngineConfig(
        workers=3,
        start_method="forkserver",
        worker_env={**DEFAULT_WORKER_ENV, "A": "1"},
        prefetch=4,
        slot_bytes=4096,
        stage_slots=3,  # the caller's stage and the device stage's
        autotune=None,
        faults=config.faults,
    )
    assert engine.faults is config.faults  # the group as it is, not copies of its fields
    with pytest.raises(TypeError):
        EngineConfig(3, "fork")  # type: ignore[misc]  # no positional construction
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.workers = 4  # type: ignore[misc]
    auto = AutoWorkers(start=1, max=2)
    tuned = engine_config(LoaderConfig(execution=Execution(workers=auto)), "fork")
    assert tuned.autotune is auto and tuned.workers == auto.first
    remote = engine_config(LoaderConfig(execution=Execution(workers=2, backend=FakeBackend())), "spawn")
    assert remote.workers == 6  # workers= is per node: the coordinator sees every node's


def test_the_worker_spec_is_made_from_the_groups():
    config = LoaderConfig.from_arguments(
        fn=double, batch_fn=double, augment=double, seed=7, on_error="skip", seed_globals="sample"
    )
    spec = WorkerSpec.of(range(4), IndexProducer(range(4)), config.stages, config.batching, config.faults)
    assert (spec.fn, spec.batch_fn, spec.augment, spec.collate_fn) == (double, double, double, None)
    assert spec.batched and spec.seed == 7 and spec.skip and spec.seed_globals == "sample"
    unbatched = LoaderConfig.from_arguments(batch_size=None, seed_globals=False)
    spec = WorkerSpec.of(range(4), IndexProducer(range(4)), unbatched.stages, unbatched.batching, unbatched.faults)
    assert not spec.batched and not spec.skip and spec.seed_globals is None
    assert isinstance(spec.producer, IndexProducer)


def test_a_cache_directory_is_checked_by_the_stages_group(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # others may write, no sticky bit: they could replace the cache file
    with pytest.raises(ValueError, match="cache"):
        Stages(cache=str(open_dir))
    assert Stages(cache=str(tmp_path)).cache == str(tmp_path) and Memory(shm_dir=str(tmp_path)).shm_dir


def test_the_torch_facade_checks_procpipes_arguments_when_it_is_created():
    """``procpipe.torch.DataLoader`` makes its Loaders lazily (at ``iter()``); its procpipe-only
    arguments are now checked when it is created, as torch checks its own."""
    ptorch = pytest.importorskip("procpipe.torch", reason="torch is not installed (pip install procpipe[torch])")
    with pytest.raises(ValueError, match="shm_dir='/no/such/dir' is not a writable directory"):
        ptorch.DataLoader(list(range(8)), batch_size=2, num_workers=1, shm_dir="/no/such/dir")
    with pytest.raises(ValueError, match="max_worker_restarts must be an int >= 0, got -1"):
        ptorch.DataLoader(list(range(8)), batch_size=2, num_workers=1, max_worker_restarts=-1)
    assert len(ptorch.DataLoader(list(range(8)), batch_size=2, num_workers=1)) == 4  # valid: nothing starts
