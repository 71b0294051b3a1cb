"""The worker process: run the user's Python on a batch of indices, collate into a slot.

A worker receives small task tuples on its own pipe, produces every sample of the batch
(``fn(source[i])``), writes the collated arrays straight into the ring slot the task
names, and replies with the batch's layout (a few hundred bytes). Nothing large is
pickled unless the batch does not fit its slot.

Messages in: ``(task_id, epoch, indices, ring_id, slot, slot_bytes)``, ``slot = -1``
meaning "no slot: send the arrays inline"; ``None`` means stop.
Messages out: ``("ok", task_id, layout, nbytes, in_slot, busy_s)``,
``("err", task_id, index, exc_bytes, type_name, message, traceback, busy_s)``,
``("fatal", traceback)`` when the worker cannot start at all.
"""
from __future__ import annotations

import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import dill

from . import collate, wire
from .rng import SampleScope
from .shm import WorkerRings

_IDLE_CHECK_S = 0.25  # how often an idle worker checks that its parent is still alive


@dataclass
class WorkerSpec:
    """Everything a worker needs, shipped once per worker (by file for non-fork starts)."""

    source: Any
    fn: Callable | None
    collate_fn: Callable | None
    batched: bool
    seed: int


def dump_spec(spec: WorkerSpec) -> bytes:
    return dill.dumps(spec, protocol=dill.HIGHEST_PROTOCOL, recurse=True)


def _load_spec(spec: WorkerSpec | str) -> WorkerSpec:
    if isinstance(spec, WorkerSpec):
        return spec
    with open(spec, "rb") as f:
        return dill.load(f)


class _ParentWatch:
    """Tells whether the loader's process is gone (it may have been SIGKILLed)."""

    def __init__(self, parent_pid: int, parent_started: float) -> None:
        self.pid = parent_pid
        self.started = parent_started

    def gone(self) -> bool:
        import psutil

        try:
            return psutil.Process(self.pid).create_time() != self.started
        except psutil.NoSuchProcess:
            return True


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this worker when its parent process ends (best effort)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def worker_main(worker_id: int, conn: Any, spec: WorkerSpec | str, files_prefix: str,
                parent_pid: int, parent_started: float, env: dict[str, str]) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle
    signal.signal(signal.SIGTERM, _raise_exit)
    _die_with_parent()
    os.environ.update(env)
    parent = _ParentWatch(parent_pid, parent_started)
    try:
        try:
            loaded = _load_spec(spec)
        except BaseException:
            wire.send(conn, ("fatal", traceback.format_exc()))
            return
        _serve(conn, loaded, WorkerRings(files_prefix), parent)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the loader closed our pipe: nothing more to do
    finally:
        if parent.gone():
            # The loader was killed before it could clean up: remove its shared files.
            from .shm import SharedFiles

            orphan = SharedFiles.__new__(SharedFiles)
            orphan.prefix = files_prefix
            orphan.remove_all()


def _serve(conn: Any, spec: WorkerSpec, rings: WorkerRings, parent: _ParentWatch) -> None:
    scope = SampleScope(spec.seed)
    source, fn = spec.source, spec.fn
    while True:
        while not conn.poll(_IDLE_CHECK_S):
            if parent.gone():
                return
        task = wire.recv(conn)
        if task is None:
            return
        task_id, epoch, indices, ring_id, slot, slot_bytes = task
        started = time.perf_counter()
        index = None
        try:
            samples = []
            for index in indices:
                scope.enter(epoch, index)
                sample = source[index]
                if fn is not None:
                    sample = fn(sample)
                samples.append(sample)
            scope.leave()
            index = None
            buffer = rings.slot(ring_id, slot, slot_bytes) if slot >= 0 else None
            if not spec.batched:
                layout, nbytes, in_slot = collate.layout_value(samples[0], buffer, slot_bytes)
            elif spec.collate_fn is not None:
                layout, nbytes, in_slot = collate.layout_value(spec.collate_fn(samples), buffer, slot_bytes)
            else:
                layout, nbytes, in_slot = collate.layout_batch(samples, indices, buffer, slot_bytes)
            del samples, buffer
            wire.send(conn, ("ok", task_id, layout, nbytes, in_slot, time.perf_counter() - started))
        except Exception as exc:
            scope.leave()
            wire.send(conn, _error_reply(task_id, index, exc, time.perf_counter() - started))


def _error_reply(task_id: int, index: int | None, exc: BaseException, busy: float) -> tuple:
    try:
        exc_bytes = dill.dumps(exc, protocol=dill.HIGHEST_PROTOCOL)
    except Exception:
        exc_bytes = None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ("err", task_id, index, exc_bytes, f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc), tb, busy)

