"""Engine robustness: the coordinator never blocks, an iteration never ends short in silence,
a forked child leaves its parent's loader alone, one bad reply does not break the loader.

A hang must fail the test, not stall the suite: every iteration that could hang on a
regression runs in a daemon thread joined with a generous deadline (``within``).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import textwrap
import threading
import time

import pytest
from conftest import run_python, wait_until

from procpipe import Loader
from procpipe._consumer import epoch_iterator

DEADLINE_S = 90.0  # far beyond what any of these takes on a loaded machine; only a hang reaches it


def within(what, seconds=DEADLINE_S):
    """``what()`` run in a daemon thread: its result, its exception, or a failure after ``seconds``."""
    box = {}

    def run():
        try:
            box["value"] = what()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds:.0f} s: the loader hangs")
    if "error" in box:
        raise box["error"]
    return box["value"]


class HangOnce:
    """``fn``: returns ``i``; the first attempt at index ``at`` blocks until ``release`` exists
    (an ``O_EXCL`` marker in ``marks`` tells the first attempt from a re-run)."""

    def __init__(self, marks, at, release=None):
        self.marks, self.at = str(marks), at
        self.release = str(release) if release else os.path.join(self.marks, "never")

    def __call__(self, i):
        if i == self.at:
            try:
                os.close(os.open(os.path.join(self.marks, "attempted"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return i
            while not os.path.exists(self.release):
                time.sleep(0.01)
        return i


# --------------------------------------------------------------------------- 1. never blocks
# A task names every index of its batch (~5 bytes each above 65535): tasks of 60,000 such
# indices (~300 KB) do not fit a socket pair's buffer (~200 KB), so writing one to a worker
# busy in a hung sample blocked the coordinator thread, and with it the watchdog.
BIG, BIG_N = 60_000, 200_000


def big_batches(count):
    """``count`` batches of ``BIG`` indices, all above 65535 (the largest pickled ints)."""
    return lambda epoch: [list(range(BIG_N - BIG, BIG_N))] * count


@contextlib.contextmanager
def closing(loader):
    """``loader``, closed at the end of the ``with`` block: a close() that hangs fails the test."""
    try:
        yield loader
    finally:
        within(loader.close, 30)


def test_task_timeout_fires_while_a_worker_with_large_queued_tasks_hangs(tmp_path):
    fn = HangOnce(tmp_path, BIG_N - 1)  # the last index of batch 0
    # seed_globals=False: reseeding the global generators (~15 us a sample) would make a
    # 60,000-sample batch itself take longer than task_timeout on a busy 2-core machine.
    with closing(Loader(range(BIG_N), fn, batches=big_batches(6), workers=2, task_timeout=2,
                        seed_globals=False)) as loader:
        got = within(lambda: [len(b) for b in loader])
        stats = loader.stats()
    assert got == [BIG] * 6
    assert stats["timed_out_tasks"] == 1 and stats["worker_deaths"] == 1


def test_speculation_rescues_a_straggler_with_large_tasks(tmp_path):
    release = tmp_path / "release"
    fn = HangOnce(tmp_path, BIG_N - 1, release)
    # Batch 6 straggles (its first attempt is the one that marks the index); the 6 before
    # give the watchdog its median.
    batches = lambda epoch: [list(range(BIG_N - BIG, BIG_N - 1))] * 6 + [list(range(BIG_N - BIG, BIG_N))] * 4
    with closing(Loader(range(BIG_N), fn, batches=batches, workers=2, speculate=2.0)) as loader:
        try:
            got = within(lambda: [len(b) for b in loader])
            stats = loader.stats()
        finally:
            release.touch()
    assert got == [BIG - 1] * 6 + [BIG] * 4
    assert stats["speculative_tasks"] >= 1


def test_close_does_not_hang_on_a_worker_that_never_reads(tmp_path):
    fn = HangOnce(tmp_path, BIG_N - 1)  # batch 0 hangs; batches 1 and 2 go to the other worker
    loader = Loader(range(BIG_N), fn, batches=big_batches(6), workers=2, ordered=False)
    it = iter(loader)
    # The second batch is dispatched together with a task queued behind the hung one.
    assert within(lambda: [len(next(it)), len(next(it))]) == [BIG, BIG]
    within(loader.close, 30)
    with pytest.raises(RuntimeError, match="ended early"):
        next(it)


# --------------------------------------------------------------------------- 2. no silent short epoch
class Gate:
    """``fn``: returns ``i``; from index ``at`` on, blocks until the file ``release`` exists."""

    def __init__(self, release, at):
        self.release, self.at = str(release), at

    def __call__(self, i):
        while i >= self.at and not os.path.exists(self.release):
            time.sleep(0.005)
        return i


def in_next(thread_id):
    """Whether thread ``thread_id`` is inside ``next()`` of an epoch iterator (waiting for a batch)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_filename == epoch_iterator.__file__:
            return True
        frame = frame.f_back
    return False


def from_thread(action, when, release):
    """Run ``action()`` in a thread once ``when()`` holds; if it never does, open ``release``
    so that the test's own loop ends (and fails) instead of hanging."""
    errors = []

    def run():
        try:
            wait_until(when, DEADLINE_S, "the consumer to wait inside next()")
            action()
        except BaseException as exc:
            errors.append(exc)
            release.touch()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


@pytest.mark.parametrize("how", ["iter from another thread", "close from a signal handler"])
def test_an_iteration_ended_from_elsewhere_while_next_waits_raises(tmp_path, how):
    release = tmp_path / "release"
    loader = Loader(range(400), Gate(release, 80), batch_size=4, workers=2)
    main = threading.get_ident()
    if how == "iter from another thread":
        action = lambda: iter(loader)
    else:
        action = lambda: os.kill(os.getpid(), signal.SIGUSR1)
        previous = signal.signal(signal.SIGUSR1, lambda *_: loader.close())  # a preemption hook
    try:
        thread, errors = from_thread(action, lambda: loader.stats()["batches_consumed"] == 20 and in_next(main),
                                     release)
        got = []
        with pytest.raises(RuntimeError, match="ended early"):
            for batch in loader:
                got.append(batch)
        thread.join(DEADLINE_S)
        assert not errors, errors
        assert len(got) == 20
    finally:
        release.touch()
        loader.close()
        if how != "iter from another thread":
            signal.signal(signal.SIGUSR1, previous)


def test_two_threads_sharing_an_iterator_both_see_the_end(tmp_path):
    release = tmp_path / "release"
    with closing(Loader(range(400), Gate(release, 399), batch_size=4, workers=2)) as loader:
        it = iter(loader)
        got = [[], []]

        def consume(k):
            for batch in it:
                got[k].extend(batch.tolist())

        threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in range(2)]
        for t in threads:
            t.start()
        # Both wait inside next() for the last batch when it comes, and then for the end.
        wait_until(lambda: all(in_next(t.ident) for t in threads), DEADLINE_S, "both threads to wait in next()")
        release.touch()
        for t in threads:
            t.join(DEADLINE_S)
        assert not any(t.is_alive() for t in threads), "a thread never saw the end of the iteration"
        assert sorted(got[0] + got[1]) == list(range(400))
        with pytest.raises(StopIteration):
            next(it)


class FailAt:
    def __init__(self, at):
        self.at = at

    def __call__(self, i):
        if i == self.at:
            raise ValueError(f"bad sample {i}")
        return i


@pytest.mark.parametrize("workers", [0, 2])
def test_two_threads_sharing_an_iterator_both_see_its_error(workers):
    # A failing batch raises in the thread that takes it and the iteration goes on (as with
    # torch's DataLoader): the other thread takes the rest, and sees the end.
    with closing(Loader(range(400), FailAt(200), batch_size=4, workers=workers)) as loader:
        it = iter(loader)
        ended = [None, None]
        taken = [0, 0]

        def consume(k):
            try:
                for _ in it:
                    taken[k] += 1
                ended[k] = "StopIteration"
            except BaseException as exc:
                ended[k] = exc

        threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        assert not any(t.is_alive() for t in threads), "a thread never saw the end of the iteration"
    original = [e for e in ended if isinstance(e, ValueError)]
    assert len(original) == 1 and "bad sample 200" in str(original[0])
    assert ended.count("StopIteration") == 1, ended
    assert sum(taken) == 99  # every batch but the failing one, once


# --------------------------------------------------------------------------- 3. forked children
FORK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from procpipe import Loader

    def main(mode, start_method, shm_dir):
        # (its ring in files of an shm_dir: what a child's close could remove; anonymous memory has no name)
        loader = Loader(list(range(2000)), batch_size=4, workers=2, start_method=start_method, shm_dir=shm_dir)
        pids, status = loader.worker_pids, loader.shm_prefix + "ring0"
        got, child = [], None
        for k, batch in enumerate(loader):
            got.extend(batch.tolist())
            if k == 5:
                pid = os.fork()
                if pid == 0:
                    code = 0
                    if mode == "close":
                        loader.close()
                    elif mode == "iter":
                        try:
                            iter(loader)
                            code = 4
                        except RuntimeError as exc:
                            code = 0 if "created in another process" in str(exc) else 3
                    sys.exit(code)  # runs the exit handlers: atexit, finalizers
                child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                files_kept = os.path.exists(status)
        stats = loader.stats()
        again = sorted(i for b in loader for i in b.tolist())
        print(json.dumps({"complete": sorted(got) == list(range(2000)), "again": again == list(range(2000)),
                          "child": child, "files_kept": files_kept, "deaths": stats["worker_deaths"],
                          "same_workers": loader.worker_pids == pids}))
        loader.close()

    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2], sys.argv[3])
""")


@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
@pytest.mark.parametrize("mode", ["exit", "close", "iter"])
def test_a_forked_child_leaves_its_parents_loader_alone(tmp_path, mode, start_method, shm_dir):
    script = tmp_path / "fork_child.py"
    script.write_text(FORK_SCRIPT)
    done = run_python([str(script), mode, start_method, shm_dir])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "complete": True, "again": True, "child": 0, "files_kept": True, "deaths": 0, "same_workers": True}
    # Nothing of procpipe's failed in the child's exit handlers either. (On Python 3.12,
    # multiprocess's own ResourceTracker.__del__ in a forked child waits for a tracker that
    # is not its child and prints an ignored ChildProcessError: not procpipe's, not fatal.)
    tracebacks = done.stderr.split("Traceback")[1:]
    assert not [t for t in tracebacks if "procpipe" in t], done.stderr


# --------------------------------------------------------------------------- 4. a reply that does not unpickle
class Unpicklable:
    """Pickles anywhere; unpickling it raises ValueError (``int("x")``)."""

    def __reduce__(self):
        return int, ("x",)


class BadOnce:
    """``fn``: ``{"i": i, "tag": ...}``; the tag of index ``at`` is an ``Unpicklable`` on its first
    attempt only (an ``O_EXCL`` marker), so the next epoch is clean."""

    def __init__(self, marks, at):
        self.marks, self.at = str(marks), at

    def __call__(self, i):
        tag = "ok"
        if i == self.at:
            try:
                os.close(os.open(os.path.join(self.marks, "bad"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                tag = Unpicklable()
            except FileExistsError:
                pass
        return {"i": i, "tag": tag}


def test_a_reply_that_does_not_unpickle_names_the_index_and_the_loader_goes_on(tmp_path):
    with Loader(range(40), BadOnce(tmp_path, 13), batch_size=4, workers=2) as loader:
        with pytest.raises(ValueError, match="invalid literal") as info:
            for _ in loader:
                pass
        notes = "\n".join(info.value.__notes__)
        assert "index 13" in notes and "batch 3" in notes and "could not be unpickled" in notes
        assert sorted(i for b in loader for i in b["i"].tolist()) == list(range(40))  # the next epoch


def test_a_reply_that_does_not_unpickle_is_skipped_with_on_error_skip(tmp_path):
    with Loader(range(40), BadOnce(tmp_path, 13), batch_size=4, workers=2, on_error="skip", max_skipped=4) as loader:
        got = sorted(i for b in loader for i in b["i"].tolist())
        assert 13 in loader.stats()["skipped"]
        assert got == [i for i in range(40) if i not in loader.stats()["skipped"]]
        assert sorted(i for b in loader for i in b["i"].tolist()) == list(range(40))


def test_outbox_never_blocks_and_frames_messages_as_recv_bytes_reads_them():
    import multiprocess

    from procpipe._core import wire
    from procpipe._core.messages import STOP, Task

    ours, theirs = multiprocess.Pipe(duplex=True)
    outbox = wire.Outbox(ours)
    try:
        messages = [Task(k, 0, list(range(k * 50_000, (k + 1) * 50_000)), 0, -1, 0) for k in range(6)]  # ~250 KB each
        for m in messages:
            outbox.put(m)
        started = time.monotonic()
        assert outbox.flush() is False  # the peer reads nothing: the socket fills, flush returns
        assert time.monotonic() - started < 30
        outbox.drop_unsent()  # keeps the message partly written, drops those not begun
        outbox.put(STOP)
        got = []
        inbox = wire.Inbox(theirs)  # (never blocks on a frame written in part: this thread writes the rest)
        while not got or got[-1] is not STOP:
            outbox.flush()
            if not _readable(theirs, 5):
                pytest.fail("the peer never received the rest")
            got.extend(wire.decode(data) for data in inbox.receive())
        inbox.close()
        # Whole messages, in order: those written before the drop (the last one finished), then "stop".
        assert got[-1] is STOP and got[:-1] == messages[:len(got) - 1] and 1 <= len(got) - 1 < len(messages)
        assert all(type(m) is Task for m in got[:-1])
        assert not outbox.pending
    finally:
        outbox.close()
        ours.close()
        theirs.close()


def test_inbox_returns_whole_frames_in_order_however_the_bytes_arrive():
    """The reader of replies and tasks (wire.Inbox): small frames several at once, a frame split
    across reads (its header too), one larger than a read, the 8-byte-length form, then the close."""
    import multiprocess

    from procpipe._core import wire
    from procpipe._core.messages import BatchDone, Task

    ours, theirs = multiprocess.Pipe(duplex=True)
    inbox = wire.Inbox(ours)
    try:
        assert inbox.receive() == [] and not inbox.closed  # nothing yet: never blocks
        small = [BatchDone(k, [0, "<i8", (64,), 0], 512, True, 0.001) for k in range(5)]
        large = Task(9, 1, list(range(200_000)), 0, -1, 0)  # ~1 MB: more than one read
        stream = b"".join(wire.frame(wire.encode(m)) for m in small) + wire.frame(wire.encode(large))
        stream += b"\xff\xff\xff\xff" + (3).to_bytes(8, "big") + b"abc"  # the long-length form
        got: list = []
        for a, b in ((0, 2), (2, 3), (3, 40)):  # a header split, then a body split
            os.write(theirs.fileno(), stream[a:b])
            assert _readable(ours)
            got.extend(inbox.receive())
            assert got == [] and not inbox.closed
        writer = threading.Thread(target=os.write, args=(theirs.fileno(), stream[40:]))  # (blocks until read)
        writer.start()
        while len(got) < len(small) + 2 and _readable(ours):
            got.extend(inbox.receive())
        writer.join()
        assert [wire.decode(f) for f in got[:-1]] == [*small, large]
        assert got[-1] == b"abc"
        theirs.close()
        assert _readable(ours)
        assert inbox.receive() == [] and inbox.closed
    finally:
        inbox.close()
        ours.close()


def _readable(conn, timeout: float = 10.0) -> bool:
    import select

    return bool(select.select([conn.fileno()], [], [], timeout)[0])


class DieOnce:
    """``fn``: returns ``i``; the first attempt at each index of ``at`` ends its worker (``os._exit``)."""

    def __init__(self, marks, at):
        self.marks, self.at = str(marks), set(at)

    def __call__(self, i):
        if i in self.at:
            try:
                os.close(os.open(os.path.join(self.marks, f"died-{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                os._exit(7)
            except FileExistsError:
                pass
        return i


def test_a_death_seen_before_its_pipe_in_one_wakeup_does_not_stop_the_coordinator(tmp_path):
    # A dying fork worker's sentinel and pipe become ready together. When the death was
    # handled first (it closes the pipe), the pipe's stale event made the coordinator read
    # a closed connection and die ("handle is closed"). The selector is made to report
    # deaths first, so every death that comes with its pipe in one wake-up hits that order.
    deaths = [5, 15, 25, 35, 45, 55]
    with Loader(range(64), DieOnce(tmp_path, deaths), batch_size=4, workers=2, start_method="fork",
                max_worker_restarts=len(deaths)) as loader:
        selector = loader._coordinator._selector
        select = selector.select

        def deaths_first(timeout=None):
            events = select(timeout)
            return sorted(events, key=lambda e: 0 if e[0].data and e[0].data[0].__name__ == "_on_exit" else 1)

        selector.select = deaths_first
        assert sorted(i for b in loader for i in b.tolist()) == list(range(64))
        assert loader.stats()["worker_deaths"] == len(deaths)
        assert sorted(i for b in loader for i in b.tolist()) == list(range(64))


def test_a_death_whose_sentinel_leaked_into_another_process_is_still_seen():
    # multiprocessing starts a worker with a pipe whose write end only the worker keeps: its
    # end closes when the worker dies, which is how the coordinator's selector sees deaths.
    # The parent closes its own copy just after the fork; a fork in another thread of the
    # program in that instant (its own multiprocessing, a subprocess) hands that process a
    # copy too, and the pipe then stays silent when the worker dies, for as long as that
    # process lives. Made to happen here: the first fork after arming forks a bystander at
    # once, before multiprocess closes its copy. The coordinator must find the death anyway.
    me = os.getpid()
    armed = [True]
    bystanders: list[int] = []
    release_r, release_w = os.pipe()

    def fork_a_bystander() -> None:
        if os.getpid() != me or not armed[0]:
            return
        armed[0] = False
        pid = os.fork()
        if pid == 0:  # holds every descriptor the parent had at this instant
            os.close(release_w)
            os.read(release_r, 1)  # (until the test releases it)
            os._exit(0)
        bystanders.append(pid)

    os.register_at_fork(after_in_parent=fork_a_bystander)  # (disarmed after its one fork)
    try:
        with Loader(range(24), batch_size=4, workers=2, start_method="fork") as loader:
            assert bystanders, "the bystander was not forked beside worker 0"
            first = loader.worker_pids[0]
            os.kill(first, signal.SIGKILL)
            wait_until(lambda: loader.worker_pids and loader.worker_pids[0] != first, timeout=30,
                       what="worker 0's replacement (its death was not seen)")
            assert sorted(i for b in loader for i in b.tolist()) == list(range(24))
            assert loader.stats()["per_worker"][0]["restarts"] == 1
    finally:
        armed[0] = False
        os.close(release_w)  # the bystander exits
        os.close(release_r)
        for pid in bystanders:
            os.waitpid(pid, 0)
