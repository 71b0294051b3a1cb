"""Fault tolerance: worker deaths, skipped samples, stragglers, exact resume, process hygiene.

Faults are injected deterministically by ``faultkit.Faulty`` (the loader's ``fn``; see
faultkit.py, shared with test_start_methods.py). Every epoch is checked for exactly-once
delivery and for values equal to an in-process (``workers=0``) reference.
"""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest
from conftest import loader_token, our_shm_files, python_env, segments, shm_files, wait_gone, wait_until
from faultkit import BS, CrashWhileFlag, FailingCollate, Faulty, N, check_epoch, reference, take

import procpipe
from procpipe import Loader, TaskTimeoutError, WorkerError
from procpipe._core.reassembly import Ordered, Progress, Sloppy


def spread(seed, count, n=N):
    return sorted(random.Random(seed).sample(range(n), count))


# --------------------------------------------------------------------------- reassembly units
def test_reassembly_refuses_duplicates_and_skips_done_positions():
    ordered = Ordered(done={1, 4})
    assert ordered.add(2, "c") == []
    assert ordered.add(0, "a") == ["a", "c"]
    assert ordered.add(2, "again") == [] and ordered.add(1, "done before") == []
    assert ordered.add(3, "d") == ["d"]
    assert ordered.add(5, "f") == ["f"]
    sloppy = Sloppy(done={0})
    assert sloppy.add(0, "x") == [] and sloppy.add(2, "y") == ["y"] and sloppy.add(2, "z") == []


def test_progress_is_a_watermark_plus_the_rest():
    p = Progress([3, 0, 5])
    assert (p.below, p.beyond) == (1, {3, 5}) and len(p) == 3 and 3 in p and 2 not in p
    for s in (1, 2, 4):
        p.add(s)
    assert (p.below, p.beyond) == (6, set()) and list(p) == list(range(6))


# --------------------------------------------------------------------------- worker deaths
@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("action,seed", [("exit", 1), ("sigkill", 2), ("segv", 3)])
def test_worker_dying_mid_epoch_changes_nothing(tmp_path, ordered, action, seed):
    victims = spread(seed, 3)
    fn = Faulty(tmp_path, {i: action for i in victims})
    with Loader(list(range(N)), fn, batch_size=BS, workers=2, ordered=ordered) as loader:
        got = [take(b) for b in loader]
        stats = loader.stats()
        again = [take(b) for b in loader]  # the replacements serve the next epoch too
    check_epoch(got, reference(0), ordered)
    check_epoch(again, reference(1), ordered)
    assert stats["worker_deaths"] == 3 and stats["redispatched_tasks"] >= 3


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("seed", [11, 12])
def test_workers_killed_from_the_consumer_loop(ordered, seed):
    rng = random.Random(seed)
    kill_at = set(rng.sample(range(1, 10), 2))
    with Loader(list(range(N)), Faulty(delay=0.004), batch_size=BS, workers=2, ordered=ordered,
                shuffle=True, seed=seed, prefetch=1) as loader:
        got = []
        for step, batch in enumerate(loader):
            got.append(take(batch))
            if step in kill_at:
                deaths = loader.stats()["worker_deaths"]
                victim = rng.choice(loader.worker_pids)
                os.kill(victim, signal.SIGKILL)
                wait_until(lambda deaths=deaths: loader.stats()["worker_deaths"] > deaths, 1.0, "the death to be detected (1 s)")
                wait_until(lambda victim=victim: victim not in loader.worker_pids, 5.0, "a replacement worker")
        assert loader.stats()["worker_deaths"] == 2
    check_epoch(got, reference(0, shuffle=True, seed=seed), ordered)


@pytest.mark.parametrize("action,how", [("exit", "exited with code 7"), ("sigkill", "killed by signal SIGKILL")])
def test_restart_budget_then_a_clear_error_and_a_working_next_epoch(tmp_path, action, how):
    flag = tmp_path / "still-broken"
    flag.touch()
    with Loader(list(range(N)), CrashWhileFlag(flag, action), batch_size=BS, workers=2,
                max_worker_restarts=2) as loader:
        with pytest.raises(WorkerError) as info:
            for _ in loader:
                pass
        message = str(info.value)
        assert how in message and "while loading index 5" in message
        assert "max_worker_restarts=2" in message and "holding indices [4, 5, 6, 7" in message
        if action == "sigkill":
            assert "out-of-memory" in message and "RSS" in message and "MiB" in message
        else:
            assert "os._exit" in message
        flag.unlink()
        check_epoch([take(b) for b in loader], reference(1), True)


# --------------------------------------------------------------------------- on_error="skip"
@pytest.mark.parametrize("workers,ordered", [(2, True), (2, False), (0, True)])
def test_skip_leaves_out_failing_samples_and_logs_them(tmp_path, caplog, workers, ordered):
    bad = spread(21, 3)
    fn = Faulty(tmp_path, {i: "raise" for i in bad}, once=False)
    caplog.set_level(logging.WARNING, logger="procpipe")
    with Loader(list(range(N)), fn, batch_size=BS, workers=workers, ordered=ordered, on_error="skip",
                max_skipped=3) as loader:
        got = [take(b) for b in loader]
        stats = loader.stats()
    check_epoch(got, reference(0), ordered, skipped=bad)
    assert sorted(stats["skipped"]) == bad
    assert stats["samples"] == N - 3
    assert sum(len(idx) < BS for idx, _ in got) == len({i // BS for i in bad})  # smaller batches, not dropped
    logged = [r.getMessage() for r in caplog.records if r.name == "procpipe"]
    for i in bad:
        assert any(f"index {i} " in m and f"bad sample {i}" in m and "ValueError" in m for m in logged), logged


def test_skip_drops_a_batch_whose_collation_fails_and_one_left_empty(tmp_path, caplog):
    whole = [8, 9, 10, 11]  # every sample raises: the batch comes out empty
    fn = Faulty(tmp_path, {i: "raise" for i in whole}, once=False)
    caplog.set_level(logging.WARNING, logger="procpipe")
    with Loader(list(range(N)), fn, batch_size=BS, workers=2, on_error="skip", max_skipped=8,
                collate_fn=FailingCollate(bad=21)) as loader:
        got = [take(b) for b in loader]
        assert sorted(loader.stats()["skipped"]) == whole + [20, 21, 22, 23]
    check_epoch(got, reference(0), True, skipped=whole + [20, 21, 22, 23])
    assert len(got) == 10
    assert any("batch 5 " in r.getMessage() and "collating it failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("workers", [2, 0])
@pytest.mark.parametrize("max_skipped", [2, 0.05])  # 0.05 of 48 samples, rounded up: 3
def test_skip_budget_raises_the_original_error(tmp_path, workers, max_skipped):
    bad = [3, 17, 30, 41]
    fn = Faulty(tmp_path, {i: "raise" for i in bad}, once=False)
    with Loader(list(range(N)), fn, batch_size=BS, workers=workers, on_error="skip",
                max_skipped=max_skipped) as loader:
        with pytest.raises(ValueError, match="bad sample") as info:
            for _ in loader:
                pass
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "max_skipped" in notes and "on_error='skip'" in notes
        assert len(loader.stats()["skipped"]) > (2 if max_skipped == 2 else 3)


def test_skip_with_worker_deaths_in_the_same_epoch(tmp_path):
    plan = {2: "raise", 13: "sigkill", 26: "raise", 35: "exit"}
    fn = Faulty(tmp_path, plan, once=True)
    with Loader(list(range(N)), fn, batch_size=BS, workers=2, ordered=False, on_error="skip", max_skipped=2) as loader:
        got = [take(b) for b in loader]
        stats = loader.stats()
    check_epoch(got, reference(0), False, skipped=[2, 26])
    assert stats["worker_deaths"] == 2 and sorted(stats["skipped"]) == [2, 26]


def test_raise_mode_reports_the_first_failure_in_order(tmp_path):
    fn = Faulty(tmp_path, {9: "raise", 30: "raise"}, once=False)
    with Loader(list(range(N)), fn, batch_size=BS, workers=2) as loader:
        got = []
        with pytest.raises(ValueError, match="bad sample 9"):
            for b in loader:
                got.append(take(b))
    assert [idx for idx, _ in got] == [idx for idx, _ in reference(0)[:2]]


@pytest.mark.parametrize("kwargs", [dict(on_error="ignore"), dict(max_skipped=-1), dict(max_skipped=1.5),
                                    dict(max_skipped=True), dict(task_timeout=0), dict(speculate=0.5),
                                    dict(speculate="3")])
def test_bad_fault_arguments(kwargs):
    with pytest.raises(ValueError):
        Loader(list(range(N)), batch_size=BS, workers=0, **kwargs)


# --------------------------------------------------------------------------- stragglers
@pytest.mark.parametrize("ordered", [True, False])
def test_speculation_rescues_a_straggler_once(tmp_path, ordered):
    fn = Faulty(tmp_path, {22: ("sleep", 1.5)}, delay=0.002)
    with Loader(list(range(N)), fn, batch_size=BS, workers=2, ordered=ordered, speculate=2.0, prefetch=1) as loader:
        got = [take(b) for b in loader]
        stats = loader.stats()
        assert stats["speculative_tasks"] >= 1
        # The losing attempt is discarded when it finally replies, and its slot freed.
        wait_until(lambda: loader.stats()["ring_slots_in_use"] == 0, 10, "the straggler's slot to be freed")
        again = [take(b) for b in loader]
    check_epoch(got, reference(0), ordered)
    check_epoch(again, reference(1), ordered)


def test_task_timeout_kills_a_stuck_worker_and_reruns_the_batch(tmp_path):
    fn = Faulty(tmp_path, {13: ("sleep", 120)})
    with Loader(list(range(N)), fn, batch_size=BS, workers=2, task_timeout=0.5) as loader:
        got = [take(b) for b in loader]
        stats = loader.stats()
    check_epoch(got, reference(0), True)
    assert stats["timed_out_tasks"] == 1 and stats["worker_deaths"] == 1


@pytest.mark.parametrize("speculate", [None, 2.0])
def test_a_batch_stuck_on_every_attempt_names_the_index(tmp_path, speculate):
    fn = Faulty(tmp_path, {13: ("sleep", 120)}, once=False)
    with Loader(list(range(N)), fn, batch_size=BS, workers=2, task_timeout=0.5, speculate=speculate) as loader:
        with pytest.raises(TaskTimeoutError) as info:
            for _ in loader:
                pass
        assert info.value.index == 13
        assert "stuck on index 13" in str(info.value) and "task_timeout=0.5" in str(info.value)
        assert "batch 3 " in str(info.value)


# --------------------------------------------------------------------------- exact resume
def _run_epoch_with_resume(tmp_path, ordered, workers_after, cut, shuffle, epoch_of_cut):
    ref = [reference(e, shuffle=shuffle, seed=7) for e in range(epoch_of_cut + 2)]
    before = []
    with Loader(list(range(N)), Faulty(), batch_size=BS, workers=2, ordered=ordered, shuffle=shuffle,
                seed=7) as first:
        for e in range(epoch_of_cut):
            check_epoch([take(b) for b in first], ref[e], ordered)
        for step, batch in enumerate(first):
            before.append(take(batch))
            if step + 1 == cut:
                break
        state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == epoch_of_cut
    with Loader(list(range(N)), Faulty(), batch_size=BS, workers=workers_after, ordered=ordered,
                shuffle=shuffle, seed=7) as second:
        second.load_state_dict(state)
        assert second.state_dict() == state
        after = [take(b) for b in second]
        following = [take(b) for b in second]
    check_epoch(before + after, ref[epoch_of_cut], ordered)
    check_epoch(following, ref[epoch_of_cut + 1], ordered)
    return state


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("seed", [31, 32, 33])
def test_resume_at_a_random_cut(tmp_path, ordered, seed):
    rng = random.Random(seed)
    cut = rng.randrange(1, N // BS)
    workers_after = rng.choice([0, 1, 3])
    _run_epoch_with_resume(tmp_path, ordered, workers_after, cut, shuffle=bool(seed % 2), epoch_of_cut=seed % 2)


def test_sloppy_resume_remembers_batches_beyond_the_watermark(tmp_path):
    release = tmp_path / "release"
    fn = Faulty(tmp_path, {0: ("wait", str(release))}, once=False)  # batch 0 waits for the consumer
    with Loader(list(range(N)), fn, batch_size=BS, workers=2, ordered=False) as first:
        it = iter(first)
        before = [take(next(it)) for _ in range(3)]
        state = json.loads(json.dumps(first.state_dict()))
        release.touch()
    assert state["done_below"] == 0 and len(state["done"]) == 3
    assert sorted(state["done"]) == sorted(idx[0] // BS for idx, _ in before)
    with Loader(list(range(N)), Faulty(), batch_size=BS, workers=1, ordered=False) as second:
        second.load_state_dict(state)
        after = [take(b) for b in second]
    check_epoch(before + after, reference(0), False)


def test_state_dict_between_epochs_and_refused_mismatch():
    with Loader(list(range(N)), Faulty(), batch_size=BS, workers=1) as loader:
        assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["done_below"] == 0
        list(loader)
        state = loader.state_dict()
        assert (state["epoch"], state["done_below"], state["done"]) == (1, 0, [])
    with Loader(list(range(N)), Faulty(), batch_size=BS + 1, workers=0) as other:
        with pytest.raises(ValueError, match="batch_size"):
            other.load_state_dict(state)
    with Loader(list(range(N)), Faulty(), batch_size=BS, workers=0) as other:
        other.load_state_dict(state)
        check_epoch([take(b) for b in other], reference(1), True)


def test_resume_after_worker_deaths_and_skips(tmp_path):
    plan = {1: "sigkill", 6: "raise", 40: "exit"}
    with Loader(list(range(N)), Faulty(tmp_path, plan), batch_size=BS, workers=2, ordered=False,
                on_error="skip") as first:
        it = iter(first)
        before = [take(next(it)) for _ in range(5)]
        state = first.state_dict()
    with Loader(list(range(N)), Faulty(tmp_path / "none"), batch_size=BS, workers=2, ordered=False,
                on_error="skip") as second:
        second.load_state_dict(state)
        after = [take(b) for b in second]
    skipped = [6] if any(6 // BS == idx[0] // BS for idx, _ in before) else []
    check_epoch(before + after, reference(0), False, skipped=skipped)


# --------------------------------------------------------------------------- hygiene
def test_many_loaders_leak_nothing():
    me = psutil.Process()

    def cycle():
        with Loader(list(range(8)), batch_size=4, workers=1, prefetch=1) as loader:
            assert sum(len(b) for b in loader) == 8

    for _ in range(10):  # warm up: the forkserver, lazily imported modules
        cycle()
    fds, threads, files = me.num_fds(), me.num_threads(), our_shm_files()
    for _ in range(200):
        cycle()
    # join() returns a moment before the OS thread (and what it holds) is gone: poll with a
    # deadline. A leak would add one per cycle, 200 here, and never settle.
    wait_until(lambda: me.num_fds() <= fds, timeout=5, what=f"open file descriptors back to {fds}")
    wait_until(lambda: me.num_threads() <= threads, timeout=5, what=f"threads back to {threads}")
    assert our_shm_files() == files == set(), "shared-memory files leak"


def test_many_epochs_leak_nothing():
    me = psutil.Process()
    with Loader(list(range(64)), Faulty(), batch_size=8, workers=2) as loader:
        for _ in range(5):
            list(loader)
        workers = [psutil.Process(p) for p in loader.worker_pids]
        token = loader_token(loader)
        held = lambda: sorted(n for n in segments() if n.startswith(token))  # noqa: E731
        fds, threads, memory = me.num_fds(), me.num_threads(), held()
        rss = [w.memory_info().rss for w in workers]
        for _ in range(45):
            assert sum(len(idx) for idx, _ in loader) == 64
        assert me.num_fds() <= fds and me.num_threads() <= threads
        assert held() == memory
        assert loader.worker_pids == [w.pid for w in workers]
        grown = [w.memory_info().rss - r for w, r in zip(workers, rss, strict=True)]
        assert max(grown) < 4 << 20, f"worker RSS grew by {grown} bytes over 45 epochs"


PARENT = textwrap.dedent('''
    import os, sys, time
    import numpy as np
    import procpipe

    MARKS, SHM_DIR = sys.argv[1:3]

    def stuck(i):
        if i >= 8:  # the first batches come back; then every worker sits in a long task
            open(os.path.join(MARKS, f"{os.getpid()}-{i}"), "w").close()
            time.sleep(600)
        return np.full(4, i)

    if __name__ == "__main__":
        # The fork-started loader first: forking while another loader's thread runs is unsafe.
        b = procpipe.Loader(list(range(1000)), stuck, batch_size=4, workers=2, ordered=False, start_method="fork")
        # a: its ring in files of an shm_dir; b: anonymous memory (the default)
        a = procpipe.Loader(list(range(1000)), stuck, batch_size=2, workers=2, speculate=2.0, task_timeout=300,
                            shm_dir=SHM_DIR)
        ia, ib = iter(a), iter(b)
        next(ia), next(ib)
        print(a.shm_prefix, b.shm_prefix, *a.worker_pids, *b.worker_pids, flush=True)
        # Block for good: a's batches of indices 0-7 come back, the one of 8 and 9 never does. (A
        # single next() returned the ready second batch, and the test only passed while closing at
        # exit waited 2 s per loader for the stuck workers: a busy worker now leaves at once.)
        for _ in ia:
            pass
        sys.exit("the loader ended instead of blocking on its stuck workers")
''')


@pytest.mark.allow_leaks  # checked here, with a tighter deadline; the child is not this process
def test_sigkilled_parent_while_workers_are_mid_task(tmp_path, shm_dir):
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(script), str(marks), shm_dir], stdout=subprocess.PIPE, text=True,
                            env=python_env(), cwd=str(tmp_path))
    tree, prefixes = set(), []
    try:
        line = proc.stdout.readline().split()
        assert len(line) == 6, f"the parent did not start: {line}"
        prefixes, pids = line[:1], [int(p) for p in line[2:]]
        assert line[1] == "None"  # (b's memory is anonymous: no file names)
        wait_until(lambda: len({name.split("-")[0] for name in os.listdir(marks)}) == 4, 30,
                   f"all four workers {pids} to be inside a long task")
        tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} | set(pids)
        assert all(shm_files(p) for p in prefixes)
        assert any(n.startswith(f"procpipe-{proc.pid}-") for n in segments(proc.pid))
        assert proc.poll() is None, "the parent ended by itself: it must be blocked in next() when killed"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        survivors = wait_gone(pids, 2.0)
        assert survivors == [], f"workers {survivors} outlived their SIGKILLed parent by 2 s"
        survivors = wait_gone(tree, 10.0)
        assert survivors == [], f"processes {survivors} outlived their SIGKILLed parent by 10 s"
        wait_until(lambda: not any(shm_files(p) for p in prefixes), 5, "the shared-memory files to be removed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        for pid in tree:  # never leave a process or a file behind, even on failure
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        for prefix in prefixes:
            for path in shm_files(prefix):
                os.unlink(path)


def test_reply_event_of_a_worker_whose_death_was_just_handled_is_ignored():
    """One select() round can report a worker's sentinel and its pipe together; the death
    handler (first) closes the pipe, and the pipe's callback must then do nothing (it used
    to call fileno() on the closed pipe: OSError out of the coordinator's loop)."""
    from types import SimpleNamespace

    import multiprocess

    from procpipe._core.stats import WorkerCounters
    from procpipe._engine.delivery import Delivery
    from procpipe._engine.pool import LocalWorker

    ours, theirs = multiprocess.Pipe()
    link = LocalWorker(0, SimpleNamespace(pid=1), ours, WorkerCounters(), [-1, -1])
    theirs.close()
    link.outbox.close()
    ours.close()
    assert link.read() is None  # a closed channel, not an error

    def unregister(fd):
        raise KeyError(fd)  # already unregistered by the death handler

    handled = []
    coordinator = SimpleNamespace(on_message=lambda *a: handled.append(a), selector=SimpleNamespace(unregister=unregister))
    Delivery.on_readable(coordinator, link)
    assert handled == []


# --------------------------------------------------------------------------- device_fn's batch_rng, workers=0
def _shard_records(shard: list) -> list:
    return shard


# --------------------------------------------------------------------------- speculation helps a stream
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
