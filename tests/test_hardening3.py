"""Issue 21 (hardening, third round): each test reproduces one defect found on main."""
from __future__ import annotations

import numpy as np
import pytest

import procpipe
from procpipe.errors import CollateError


# --------------------------------------------------------------------------- 1: unpicklable sample
def _with_generator(i: int) -> dict:
    return {"x": np.float32(i), "g": (k for k in range(3)) if i == 5 else None}


def test_unpicklable_value_is_its_batchs_error_and_the_worker_lives() -> None:
    loader = procpipe.Loader(list(range(16)), fn=_with_generator, batch_size=4, workers=2, max_worker_restarts=0)
    it = iter(loader)
    got, errors = [], []
    for _ in range(4):
        try:
            got.append(next(it)["x"].tolist())
        except CollateError as exc:
            errors.append(str(exc))
    with pytest.raises(StopIteration):
        next(it)
    assert len(errors) == 1 and "sample['g'] of index 5" in errors[0] and "generator" in errors[0], errors
    assert "pickle" in errors[0]
    assert sorted(got) == [[0.0, 1.0, 2.0, 3.0], [8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0]]
    assert loader.stats()["worker_deaths"] == 0
    loader.close()


# --------------------------------------------------------------------------- 6: no cycle keeps a loader
def _zeros(i: int) -> np.ndarray:
    return np.zeros(256, np.float32) + i


def _records(shard: list) -> list:
    return shard


@pytest.mark.parametrize("streaming", [False, True], ids=["indexed", "shards"])
def test_abandoned_loader_frees_its_files_without_the_garbage_collector(streaming: bool) -> None:
    import gc
    import weakref

    from conftest import our_segments

    before = our_segments()
    source = procpipe.Shards([list(range(64)), list(range(64))], _records) if streaming else list(range(128))
    gc.collect()
    gc.disable()  # a re-run notebook cell: the loader is dropped mid-epoch, and no collection runs
    try:
        loader = procpipe.Loader(source, fn=_zeros, batch_size=4, workers=2)
        for k, _batch in enumerate(loader):
            if k == 2:
                break
        del _batch  # the last batch holds a ring slot: the loader is dropped with none in hand
        assert our_segments() - before, "the loader made no shared memory: the test proves nothing"
        gone = weakref.ref(loader)
        del loader
        assert gone() is None, "a reference cycle keeps the abandoned loader alive"
        assert our_segments() - before == set()  # no descriptor and no mapping of its memory left
    finally:
        gc.enable()


# --------------------------------------------------------------------------- 7: device_fn's batch_rng, workers=0
def _shard_records(shard: list) -> list:
    return shard


def _as_float(record: int) -> np.float32:
    return np.float32(record)


def _noisy(batch):
    return batch + float(procpipe.batch_rng().integers(1_000_000))


def test_device_fn_batch_rng_is_the_same_with_and_without_workers_for_a_stream() -> None:
    pytest.importorskip("torch", reason="device= needs torch")

    def run(workers: int) -> list:
        shards = procpipe.Shards([list(range(10)), list(range(10, 20))], _shard_records)
        with procpipe.Loader(shards, fn=_as_float, batch_size=4, workers=workers, device="cpu",
                             device_fn=_noisy, epochs=2) as loader:
            return [batch.tolist() for batch in loader]

    inline, pooled = run(0), run(2)
    assert len(inline) == 10 and inline == pooled


# --------------------------------------------------------------------------- 2: speculation helps a stream
class _StallFirstAttempt:
    """fn: the first attempt at record 13 stalls until ``release`` exists (at most 30 s), then
    writes ``finished``; any other attempt (speculation's, on another worker) is quick."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, record: int) -> np.float32:
        import os
        import time

        if record == 13:
            try:
                os.close(os.open(os.path.join(self.directory, "stalled"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                deadline = time.monotonic() + 30
                while not os.path.exists(os.path.join(self.directory, "release")) and time.monotonic() < deadline:
                    time.sleep(0.01)
                open(os.path.join(self.directory, "finished"), "w").close()
        time.sleep(0.002)
        return np.float32(record)


def test_speculation_lets_a_stream_go_on_past_a_stalled_block(tmp_path) -> None:
    shards = [list(range(k * 20, k * 20 + 20)) for k in range(4)]
    source = procpipe.Shards(shards, _shard_records, block_length=4)
    with procpipe.Loader(source, fn=_StallFirstAttempt(str(tmp_path)), batch_size=4, workers=2,
                         speculate=2.0) as loader:
        got = sorted(r for batch in loader for r in batch.tolist())
        # Every batch arrived while the first attempt was still stalled: the speculative one was used,
        # and the shard's later blocks did not wait behind the straggler.
        assert not (tmp_path / "finished").exists()
        (tmp_path / "release").touch()
        assert loader.stats()["speculative_tasks"] >= 1
    assert got == list(range(80))


def test_a_straggling_workers_lane_moves_even_without_a_copied_task() -> None:
    """A shard's lane held by a straggler that has no task of that shard to copy (its queue
    holds another shard's blocks) goes to a healthy worker: it used to stay, and the shard's
    later blocks waited for the straggler's reply (the test above, now and then, under load)."""
    from types import SimpleNamespace

    from procpipe._engine.roster import Roster

    def link(index: int, stalled: bool) -> SimpleNamespace:
        return SimpleNamespace(index=index, stalled=stalled, retiring=False, usable=True, dead=False, fatal=None,
                               tasks={})

    straggler, healthy = link(0, True), link(1, False)
    roster = SimpleNamespace(links=[straggler, healthy])
    epoch = SimpleNamespace(plan=SimpleNamespace(lanes_held=lambda: {0: 2, 1: 2}))
    assert Roster.for_lane(roster, SimpleNamespace(worker=0), epoch) is healthy  # the lane moves
    assert Roster.for_lane(roster, SimpleNamespace(worker=None), epoch) is healthy  # a new lane avoids it
    straggler.stalled = False  # it replied: its lane is its own again
    assert Roster.for_lane(roster, SimpleNamespace(worker=0), epoch) is straggler


# --------------------------------------------------------------------------- 3: streams without lengths
def _fails_on_multiples(every: int):
    def fn(record: int) -> np.float32:
        if record % every == every - 1:
            raise ValueError(f"bad record {record}")
        return np.float32(record)
    return fn


@pytest.mark.parametrize("workers", [0, 2])
def test_stream_skips_a_fraction_of_the_records_seen_so_far(workers: int) -> None:
    shards = [list(range(k * 50, k * 50 + 50)) for k in range(4)]  # no lengths=: the epoch's size is unknown
    with procpipe.Loader(procpipe.Shards(shards, _shard_records), fn=_fails_on_multiples(25), batch_size=5,
                         workers=workers, on_error="skip", max_skipped=0.05) as loader:
        got = sorted(r for batch in loader for r in batch.tolist())
        assert len(loader.stats()["skipped"]) == 8
    assert got == [r for r in range(200) if r % 25 != 24]
    with procpipe.Loader(procpipe.Shards(shards, _shard_records), fn=_fails_on_multiples(5), batch_size=5,
                         workers=workers, on_error="skip", max_skipped=0.05) as loader:
        with pytest.raises(ValueError, match="bad record") as raised:
            list(loader)
    assert "samples seen so far" in "\n".join(getattr(raised.value, "__notes__", []))


# --------------------------------------------------------------------------- 9: Ctrl-C twice
CTRL_C_SCRIPT = r"""
import os, signal, sys, time
import numpy as np
import procpipe
from procpipe._engine.coordinator import Coordinator

close = Coordinator.close


def note(what):
    with open(sys.argv[1], "a") as f:
        f.write(what + "\n")


def close_with_a_second_ctrl_c(self, *args, **kwargs):
    note("closing")
    if sys.argv[2] == "twice":
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C again while the loader closes at exit
    close(self, *args, **kwargs)


Coordinator.close = close_with_a_second_ctrl_c


def slow(i):
    note("sample")
    time.sleep(0.05)
    return np.zeros(256, np.float32) + i


loader = procpipe.Loader(list(range(100_000)), fn=slow, batch_size=4, workers=2)
for k, batch in enumerate(loader):
    if k == 2:
        print("looping", flush=True)
"""


@pytest.mark.parametrize("presses", ["once", "twice"])
def test_ctrl_c_exits_without_noise_or_waiting_for_queued_batches(tmp_path, presses: str) -> None:
    import subprocess
    import sys

    from conftest import CTRL_C_READY, interrupt, python_env, shm_files

    script = tmp_path / "train.py"
    script.write_text(CTRL_C_READY + CTRL_C_SCRIPT)  # (Ctrl-C reaches it however pytest was started)
    notes = tmp_path / "notes"
    child = subprocess.Popen([sys.executable, str(script), str(notes), presses], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=python_env())
    try:
        assert child.stdout.readline() == "looping\n"
        _, stderr = interrupt(child, 60)  # (a child that does not exit fails with its stacks)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert stderr.rstrip().endswith("KeyboardInterrupt"), stderr
    assert "Exception ignored" not in stderr and "lost sys.stderr" not in stderr, stderr
    assert stderr.count("KeyboardInterrupt") == 1, stderr  # one traceback: the loop's
    assert shm_files(f"/dev/shm/procpipe-{child.pid}-") == []
    # Exiting does not wait for the batches queued in the workers' pipes (before: every task queued,
    # tens of samples): at most two per worker, the one under way as the close began and one it may
    # start before the close's ABANDON_SIGNAL reaches it (a 50 ms sample: under load, that happened
    # once in 50 runs with a bound of one per worker).
    lines = notes.read_text().splitlines()
    assert lines.count("closing") == 1 and lines[lines.index("closing") + 1:].count("sample") <= 4, lines
