"""Issue 43 (hardening, fourth round): each test reproduces one defect found on main."""
from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

import procpipe
from procpipe._engine.pool import LocalWorker


# --------------------------------------------------------------------------- 1: descriptors of killed workers
class _HangsOnce:
    """Indices in ``hang`` hang on their first attempt (a marker file, shared by the workers,
    says it was made): the worker is killed after ``task_timeout``, and the retry returns."""

    def __init__(self, directory: str, hang: set[int], n: int, pace_s: float) -> None:
        self.directory, self.hang, self.n, self.pace_s = directory, hang, n, pace_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.float32:
        if i in self.hang:
            try:
                fd = os.open(os.path.join(self.directory, f"hung-{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass  # the retry
            else:
                os.close(fd)
                time.sleep(120)  # stuck: only the kill ends it
        time.sleep(self.pace_s)  # (the epoch outlasts task_timeout after the last hang: its kill counts)
        return np.float32(i)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("speculate", [None, 2.0], ids=["task_timeout", "speculate_lost"])
def test_killed_workers_descriptors_are_closed_without_the_garbage_collector(tmp_path, speculate) -> None:
    warm = procpipe.Loader(list(range(8)), batch_size=2, workers=2)  # (lazily made process-wide parts)
    list(warm)
    warm.close()
    del warm
    gc.collect()
    gc.disable()  # a job that freezes or disables the GC: nothing may wait for a collection
    try:
        before = _open_descriptors()
        hang, n = {6, 12, 18}, 64
        loader = procpipe.Loader(
            _HangsOnce(str(tmp_path), hang, n, pace_s=0.02), batch_size=1, workers=2, shuffle=False,
            task_timeout=0.5, speculate=speculate,
        )
        got = [int(x) for b in loader for x in b.tolist()]
        killed = loader.stats()["worker_deaths"]  # (each one killed: no sample fails)
        loader.close()
        del loader
        after = _open_descriptors()
        links = [o for o in gc.get_objects() if isinstance(o, LocalWorker)]  # (uncollected garbage included)
    finally:
        gc.enable()
    assert got == list(range(n))
    assert killed == len(hang), "the workers were not killed: the test proves nothing"
    assert after == before, f"{after - before} descriptors left open after {killed} workers were killed and close()"
    assert links == [], f"{len(links)} worker links kept by a reference cycle after close()"
