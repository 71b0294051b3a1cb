"""The coordinator's parts, tested in-process against a fake pool (no worker processes).

The coordinator (_engine/coordinator.py) is a loop of named steps over parts: the worker
``Roster`` (roster.py), the ``Dispatcher`` with its speculation (dispatch.py), the verdict
on a death (``deaths.settle``), the ring generations (``RingSet``), typed commands and the
``WakePipe`` (_core/wakeup.py). Each is driven here with ``FakePool``/``FakeLink`` (the
``WorkerPool``/``WorkerLink`` interface of _engine/pool.py, recording what is sent) and
stand-in epochs, so deaths, timeouts and speculation are checked without a process.
"""
from __future__ import annotations

import os
import selectors
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from procpipe._core.messages import Task
from procpipe._core.shm import Segments
from procpipe._core.stats import EpochCounters, WorkerCounters
from procpipe._core.wakeup import WakePipe
from procpipe._engine.commands import CancelIteration, CloseEngine, StartIteration, checked
from procpipe._engine.deaths import Next, settle
from procpipe._engine.dispatch import Dispatcher, needs_copy
from procpipe._engine.epochs import Job
from procpipe._engine.pool import WorkerLink, WorkerPool
from procpipe._core.rings import RingSet
from procpipe._engine.roster import Roster, WorkerState, state_of


# --------------------------------------------------------------------------- fakes
class FakeLink(WorkerLink):
    """A worker with no process: what is put on it is recorded; how it ended is set by the test."""

    def __init__(self, index: int, counters: WorkerCounters) -> None:
        super().__init__(index, counters)
        self.sent: list[Any] = []
        self.killed = False
        self.start_failed = False
        self.stuck_index: int | None = None

    pid = None  # type: ignore[assignment]
    exitcode = None  # type: ignore[assignment]

    def describe(self) -> str:
        return f"fake worker {self.index}"

    def reply_fd(self) -> int:
        return -1

    def exit_fd(self) -> int:
        return -1

    def read(self) -> list | None:
        return []

    def put(self, message: Any) -> None:
        self.sent.append(message)

    def flush(self) -> bool:
        return True

    def write_fd(self) -> int:
        return -1

    def reap(self) -> None:
        pass

    def kill(self) -> None:
        self.killed = True

    def stuck_on(self, attempt: Any) -> int | None:
        return self.stuck_index

    def failed_to_start(self) -> bool:
        return self.start_failed


class FakePool(WorkerPool):
    uses_ring = False

    def __init__(self) -> None:
        self.started: list[int] = []

    def start(self, index: int, counters: WorkerCounters) -> WorkerLink:
        self.started.append(index)
        return FakeLink(index, counters)

    def stop(self, links: list[WorkerLink]) -> None:
        pass


def fake_epoch(number: int = 0) -> Any:
    """The parts of an ``Epoch`` the dispatcher and ``settle`` touch."""
    return SimpleNamespace(number=number, finished=False, counters=EpochCounters(),
                           moved=lambda job, worker: epoch_moves.append((job, worker)))


epoch_moves: list = []


def make_job(epoch: Any, key: int = 0) -> Job:
    return Job(epoch, SimpleNamespace(key=key, payload=[key]))


def engine(workers: int = 2, tasks_per_worker: int = 2) -> tuple[Roster, Dispatcher, FakePool]:
    pool = FakePool()
    roster = Roster(pool, workers, workers, tasks_per_worker)
    for i in range(workers):
        link = roster.start(i)
        roster.mark_ready(link)
        roster.links.append(link)
    rings = RingSet(SimpleNamespace(directory="/nonexistent"), WakePipe())  # type: ignore[arg-type]
    return roster, Dispatcher(roster, rings, False, 2, lambda worker: None), pool


# --------------------------------------------------------------------------- wake pipe, commands
@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_wake_pipe_wakes_select_once_starved_and_ignores_a_wake_after_close():
    wakeup = WakePipe()
    with selectors.DefaultSelector() as selector:
        selector.register(wakeup.fileno(), selectors.EVENT_READ)
        wakeup.wake_if_starved()  # not starved: no byte
        assert selector.select(0) == []
        wakeup.starved = True
        wakeup.wake_if_starved()
        assert not wakeup.starved and len(selector.select(0)) == 1
        for _ in range(100_000):  # a full pipe means "already awake": never blocks
            wakeup.wake()
        wakeup.drain()
        assert selector.select(0) == []
        selector.unregister(wakeup.fileno())
    wakeup.close()
    wakeup.close()
    wakeup.wake()  # after close: ignored, not written to a reused descriptor
    assert wakeup.fileno() == -1


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_commands_are_typed_and_a_name_is_refused():
    typed = StartIteration(object())  # type: ignore[arg-type]
    assert checked(typed) is typed and isinstance(checked(CancelIteration(1)), CancelIteration)
    assert isinstance(checked(CloseEngine()), CloseEngine)
    for wrong in ("close", ("cancel", 3), None):
        with pytest.raises(TypeError, match=r"StartIteration, CancelIteration, ReserveSlots or CloseEngine.*not "):
            checked(wrong)


# --------------------------------------------------------------------------- roster
@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_roster_states_from_start_to_death():
    roster = Roster(FakePool(), 3, 3, 2)
    link = roster.start(2)
    assert len(roster.counters) == 3 and link.counters is roster.counters[2]
    assert state_of(link) is WorkerState.STARTING
    roster.mark_ready(link)
    assert state_of(link) is WorkerState.READY
    link.tasks[0] = object()  # type: ignore[assignment]
    assert state_of(link) is WorkerState.BUSY
    link.retiring = True
    assert state_of(link) is WorkerState.RETIRING
    roster.mark_dead(link)
    assert state_of(link) is WorkerState.DEAD


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_roster_picks_the_least_loaded_healthy_worker_and_retires_the_highest():
    roster, dispatcher, _ = engine(workers=3)
    a, b, c = roster.links
    a.tasks.update({1: object(), 2: object()})  # type: ignore[dict-item]
    b.tasks[3] = object()  # type: ignore[assignment]
    c.stalled = True
    assert roster.idle() is b  # a is full, c straggles
    b.tasks[4] = object()  # type: ignore[assignment]
    assert roster.idle() is None
    assert roster.to_retire() is c
    roster.retire(c)
    assert c.retiring and c.stop_sent and roster.n_workers == 2  # idle: told to stop at once
    dispatcher.set_outstanding()
    assert dispatcher.max_outstanding == 2 + 2 * 2
    roster.retire(roster.to_retire())  # type: ignore[arg-type]
    assert roster.to_retire() is None  # never the last live worker
    assert roster.free_index() is None and roster.states()[0] is WorkerState.BUSY


# --------------------------------------------------------------------------- dispatch and speculation
@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_send_records_the_attempt_and_puts_a_task_without_a_ring():
    roster, dispatcher, _ = engine()
    epoch = fake_epoch(number=5)
    job = make_job(epoch, key=7)
    worker = roster.links[0]
    dispatcher.send(worker, job, -1)
    (attempt,) = job.attempts
    assert dispatcher.attempts == {attempt.id: attempt} and worker.tasks == {attempt.id: attempt}
    (task,) = worker.sent
    assert type(task) is Task and tuple(task) == (attempt.id, 5, [7], -1, -1, 0)
    assert attempt.started is not None  # an idle, ready worker starts it now


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_speculation_copies_a_stragglers_batch_to_a_healthy_worker_once():
    roster, dispatcher, _ = engine(workers=3)
    slow, fast, other = roster.links
    epoch = fake_epoch()
    job = make_job(epoch)
    dispatcher.send(slow, job, -1)
    assert needs_copy(roster.links) == []  # nobody straggles yet
    slow.stalled = True
    assert needs_copy(roster.links) == [job.attempts[0]]
    epoch_moves.clear()
    dispatcher.speculate()
    assert [a.worker for a in job.attempts] == [slow, fast]
    assert epoch.counters.speculative_tasks == 1 and epoch_moves == [(job, 0 + 1)]
    dispatcher.speculate()  # running on a healthy worker now: no third copy
    assert len(job.attempts) == 2 and not other.sent
    assert needs_copy(roster.links) == []


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_no_speculation_for_a_batch_that_timed_out_already_or_is_done():
    roster, dispatcher, _ = engine()
    slow = roster.links[0]
    timed, done = make_job(fake_epoch(), 0), make_job(fake_epoch(), 1)
    dispatcher.send(slow, timed, -1)
    dispatcher.send(slow, done, -1)
    timed.timeouts = 1  # one attempt + one timeout: as often as a batch may be tried
    done.done = True
    slow.stalled = True
    assert needs_copy(roster.links) == []


# --------------------------------------------------------------------------- deaths and timeouts
def died(dispatcher: Dispatcher, worker: WorkerLink, **kwargs: Any):
    """What the coordinator does on a death: take the worker's attempts out, then settle."""
    lost = list(worker.tasks.values())
    for attempt in lost:
        dispatcher.attempts.pop(attempt.id)
    worker.tasks.clear()
    released: list[int] = []
    death = settle(worker, lost, released.append, kwargs.get("used", 0), kwargs.get("budget", 3))
    return death, released


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_a_crash_reruns_its_batches_and_restarts_the_worker():
    roster, dispatcher, _ = engine()
    worker = roster.links[0]
    jobs = [make_job(fake_epoch(), k) for k in range(2)]
    dispatcher.send(worker, jobs[0], -1)
    dispatcher.send(worker, jobs[1], -1)
    jobs[0].attempts[0].slot = 3  # (as if sent into ring slot 3)
    worker.stuck_index = 11
    death, released = died(dispatcher, worker)
    assert death.redo == jobs and [j.slot for j in jobs] == [3, -1]  # each keeps its lost slot
    assert death.next is Next.RESTART and death.counts and death.stuck_on == 11
    assert death.timed_out is None and released == [] and not dispatcher.attempts


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_past_the_restart_budget_the_death_fails_the_epoch():
    roster, dispatcher, _ = engine()
    worker = roster.links[0]
    dispatcher.send(worker, make_job(fake_epoch()), -1)
    death, _ = died(dispatcher, worker, used=3, budget=3)
    assert death.next is Next.OVER_BUDGET


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_a_batch_killed_twice_for_task_timeout_fails_the_epoch():
    roster, dispatcher, _ = engine()
    epoch = fake_epoch()
    job = make_job(epoch)
    for round_ in (1, 2):
        worker = roster.links[0]
        dispatcher.send(worker, job, -1)
        worker.killed_for = job.attempts[0]  # the Watchdog killed it
        death, _ = died(dispatcher, worker)
        assert death.redo == [job] and not death.counts  # a kill is not the worker's own death
        assert job.timeouts == round_ and epoch.counters.timed_out_tasks == round_
        assert death.timed_out is (job if round_ == 2 else None)
        roster.replace(worker, roster.start(0))
        roster.mark_ready(roster.links[0])


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_a_death_gives_back_the_slots_of_batches_finished_or_running_elsewhere():
    roster, dispatcher, _ = engine()
    slow, fast = roster.links
    finished, copied = make_job(fake_epoch(), 0), make_job(fake_epoch(), 1)
    dispatcher.send(slow, finished, -1)
    dispatcher.send(slow, copied, -1)
    dispatcher.send(fast, copied, -1)  # speculation: a copy runs on the healthy worker
    for attempt, slot in zip([*finished.attempts, *copied.attempts], (4, 5, 6), strict=True):
        attempt.slot = slot  # (as if sent into these ring slots)
    finished.done = True
    death, released = died(dispatcher, slow)
    assert death.redo == [] and released == [4, 5] and [a.worker for a in copied.attempts] == [fast]


@pytest.mark.unit  # starts no process (tests/conftest.py)
@pytest.mark.parametrize("how, expected", [("retiring", Next.GONE), ("fatal", Next.FATAL),
                                           ("start_failed", Next.CANNOT_START)])
def test_what_becomes_of_a_worker_that_cannot_go_on(how: str, expected: Next):
    roster, dispatcher, _ = engine()
    worker = roster.links[1]
    setattr(worker, how, "traceback" if how == "fatal" else True)
    death, _ = died(dispatcher, worker)
    assert death.next is expected


# --------------------------------------------------------------------------- ring generations
def test_ring_set_grows_retires_and_removes_the_old_generation(tmp_path):
    wakeup = WakePipe()
    rings = RingSet(Segments(str(tmp_path)), wakeup)
    counters = EpochCounters()
    try:
        assert rings.take(counters) is None  # no ring before the first batch
        rings.make(2, 4096)
        first = rings.take(counters)
        assert first == 0 and counters.peak_slots_in_use == 1
        assert rings.grow(100, counters) is None and rings.current.ring_id == 0  # it fits: no growth
        assert rings.grow(1 << 20, counters) is None and counters.ring_growths == 1
        old, new = rings.retired[0], rings.current
        assert new.slot_bytes >= 1 << 20 and rings.ring_of(first) is old and rings.ring_of(2) is new
        wakeup.starved = True
        rings.release(first)  # the old generation's last slot: no wake-up (not the current ring)
        assert wakeup.starved
        rings.remove_idle()
        assert rings.retired == []
        rings.release(rings.take(counters))  # the current ring's slot wakes a starved coordinator
        assert not wakeup.starved
    finally:
        rings.close()
        wakeup.close()
        rings.segments.remove_all()


# --------------------------------------------------------------------------- the loop, with a fake pool
class PipeLink(FakeLink):
    """A fake worker with real descriptors, so the coordinator's selector can watch it:
    closing ``die()`` makes its exit descriptor readable, as a dead process's sentinel is."""

    def __init__(self, index: int, counters: WorkerCounters) -> None:
        super().__init__(index, counters)
        self.replies_r, self.replies_w = os.pipe()
        self.exit_r, self.exit_w = os.pipe()

    def reply_fd(self) -> int:
        return self.replies_r

    def exit_fd(self) -> int:
        return self.exit_r

    def die(self) -> None:
        # Forgotten before it is closed: the coordinator thread wakes as the descriptor closes
        # and reaps this link (close()), which must not close the same number again.
        fd, self.exit_w = self.exit_w, -1
        os.close(fd)

    def reap(self) -> None:
        self.close()

    def close(self) -> None:
        for name in ("replies_r", "replies_w", "exit_r", "exit_w"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


class PipePool(FakePool):
    def __init__(self, expect: int) -> None:
        super().__init__()
        self.links: list[PipeLink] = []
        self.expect = expect
        self.all_started = threading.Event()

    def start(self, index: int, counters: WorkerCounters) -> WorkerLink:
        link = PipeLink(index, counters)
        self.links.append(link)
        self.started.append(index)
        if len(self.started) >= self.expect:
            self.all_started.set()
        return link

    def stop(self, links: list[WorkerLink]) -> None:
        self.stopped = list(links)
        for link in self.links:
            link.close()


def loop_coordinator(tmp_path: Any, pool: PipePool, workers: int) -> Any:
    """A running ``Coordinator`` (its thread and loop) over ``pool``, with no stream yet."""
    from procpipe._engine.coordinator import Coordinator, EngineConfig

    config = EngineConfig(workers=workers, prefetch=workers, slot_bytes=None, worker_env={}, start_method="fork")
    return Coordinator(config, pool, Segments(str(tmp_path)))


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_the_coordinator_loop_replaces_a_dead_worker_and_closes_cleanly(tmp_path):
    pool = PipePool(expect=3)
    coordinator = loop_coordinator(tmp_path, pool, workers=2)
    try:
        assert pool.started == [0, 1] and coordinator.is_alive()
        pool.links[0].die()
        assert pool.all_started.wait(30), "the dead worker was not replaced"
    finally:
        coordinator.close()  # (joins the thread: what it did is all done now)
    assert not coordinator.is_alive() and pool.started == [0, 1, 0]
    assert pool.stopped == [pool.links[2], pool.links[1]]  # the replacement took the dead one's place
    assert coordinator.worker_counters[0].restarts == 1
    assert all(link.exit_r == -1 for link in pool.links)


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_a_worker_that_ended_while_its_exit_descriptor_stayed_silent_is_replaced(tmp_path):
    # (a copy of the descriptor's other end leaked into another process: test_engine_robustness)
    pool = PipePool(expect=3)
    coordinator = loop_coordinator(tmp_path, pool, workers=2)
    try:
        pool.links[1].exitcode = -9  # ended; its exit descriptor is not readable
        assert pool.all_started.wait(30), "the worker that ended was not replaced"
    finally:
        coordinator.close()
    assert pool.started == [0, 1, 1] and coordinator.worker_counters[1].restarts == 1
    assert pool.stopped == [pool.links[0], pool.links[2]]


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_the_coordinator_refuses_a_command_given_by_name(tmp_path):
    coordinator = loop_coordinator(tmp_path, PipePool(expect=1), workers=1)
    try:
        with pytest.raises(TypeError, match=r"a StartIteration, CancelIteration, ReserveSlots or CloseEngine"):
            coordinator.submit("close")  # type: ignore[arg-type]  # (the older spelling, accepted until now)
        with pytest.raises(TypeError):
            coordinator.submit("cancel", 0)  # type: ignore[call-arg]
        assert coordinator.is_alive()  # neither was queued
        coordinator.submit(CancelIteration(0))  # (no stream of generation 0: nothing to cancel)
    finally:
        coordinator.close()
    assert not coordinator.is_alive()


# --------------------------------------------------------------------------- a round's writes and deliveries
def _stream(batches: int, pending: bool) -> Any:
    from procpipe._engine.epochs import Iteration
    from procpipe._sources.indexed.index_plan import IndexPlan

    plan = [[i] for i in range(batches)]
    stream = Iteration(0, SimpleNamespace(epoch_plan=IndexPlan, batches=lambda n: plan), 0, 1, True, plan)
    if pending:
        stream.pending = []  # (as the coordinator's streams are)
    stream.open(stream.first)
    return stream


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_a_round_writes_each_workers_tasks_at_once_after_queuing_them_all():
    roster, dispatcher, _ = engine(workers=2, tasks_per_worker=3)
    flushed: list = []
    dispatcher.flush = lambda worker: flushed.append((worker.index, len(worker.sent)))  # type: ignore[assignment,misc]
    dispatcher.max_outstanding = 6
    dispatcher.round(_stream(8, pending=False))
    assert [len(w.sent) for w in roster.links] == [3, 3]
    assert flushed == [(0, 3), (1, 3)]  # one write per worker, with its three tasks queued
    job = make_job(fake_epoch())
    dispatcher.send(roster.links[0], job, -1)  # outside a round: written at once
    assert flushed[-1] == (0, 4)


@pytest.mark.unit  # starts no process (tests/conftest.py)
def test_a_coordinator_stream_holds_a_rounds_items_until_published_and_abandon_drops_them():
    from procpipe._engine.epochs import EndOfIteration

    stream = _stream(4, pending=True)
    stream.fail(RuntimeError("boom"))
    assert stream.out.empty() and len(stream.pending) == 1
    stream.publish()
    assert type(stream.out.get_nowait()).__name__ == "Failure" and not stream.pending
    stream = _stream(4, pending=True)
    stream.fail(RuntimeError("boom"))
    stream.abandon()  # the consumer is gone: what was held back goes too
    assert stream.out.get_nowait() is EndOfIteration and stream.out.empty() and not stream.pending
    direct = _stream(4, pending=False)  # (workers=0's streams: straight into the queue)
    direct.fail(RuntimeError("boom"))
    assert not direct.out.empty()
