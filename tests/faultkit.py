"""Deterministic fault injection and exactly-once checks, shared by the fault and start-method suites.

Faults are injected by ``fn``: ``Faulty`` acts on chosen indices, and only on the *first
attempt* at each when asked to, using an ``O_EXCL`` marker file in a directory (a re-run of
the batch, in whichever worker, then succeeds). Values include a draw from ``sample_rng()``,
so ``check_epoch`` against an in-process (``workers=0``) ``reference`` catches a re-run that
changed the randomness as well as a lost or doubled index.

These live in a module of their own (not in a test module) so that workers started with
``"spawn"`` or ``"forkserver"`` import them by name, as they would a user's dataset module.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from procpipe import Loader, sample_rng

N, BS = 48, 4  # 12 batches per epoch


def first_attempt(marks, name):
    """True the first time it is called with ``name`` in directory ``marks`` (in any process),
    False afterwards: an ``O_EXCL`` marker file."""
    try:
        os.close(os.open(os.path.join(str(marks), name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _load_slowly(items):
    time.sleep(2.0)  # longer than the task_timeout of the tests that use it
    return SlowToLoad(items)


class SlowToLoad(list):
    """A list whose unpickling (in each worker) takes 2 s, as a dataset that opens an index on load would."""

    def __reduce__(self):
        return _load_slowly, (list(self),)


class Faulty:
    """``fn``: returns ``(index, [index, index**2, a sample_rng() draw])``; misbehaves on ``plan``.

    ``plan`` maps an index to an action: ``"exit"`` (``os._exit(7)``), ``"sigkill"``,
    ``"segv"`` (SIGSEGV, as a crash in native code would), ``"raise"`` (ValueError),
    ``("sleep", seconds)``, or ``("wait", path)`` (block until ``path`` exists). With
    ``once=True`` an action happens only on the first attempt at that index in the
    loader's life (a marker file in ``marks``). ``delay`` is slept on every sample.
    """

    def __init__(self, marks=None, plan=None, once=True, delay=0.0):
        self.marks, self.plan, self.once, self.delay = str(marks) if marks else None, plan or {}, once, delay

    def _first_attempt(self, i):
        return not self.once or first_attempt(self.marks, f"attempted-{i}")

    def __call__(self, i):
        value = np.array([i, i * i, sample_rng().integers(1 << 40)], np.int64)
        if self.delay:
            time.sleep(self.delay)
        action = self.plan.get(i)
        if action is not None and self._first_attempt(i):
            if action == "exit":
                os._exit(7)
            elif action == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif action == "raise":
                raise ValueError(f"bad sample {i}")
            elif action[0] == "sleep":
                time.sleep(action[1])
            elif action[0] == "wait":
                while not os.path.exists(action[1]):
                    time.sleep(0.005)
        return np.int64(i), value


class CrashWhileFlag(Faulty):
    """Dies (``action``) on index 5 at every attempt while the file ``flag`` exists."""

    def __init__(self, flag, action):
        super().__init__(once=False)
        self.flag, self.action = str(flag), action

    def __call__(self, i):
        self.plan = {5: self.action} if os.path.exists(self.flag) else {}
        return super().__call__(i)


class FailingCollate:
    """``collate_fn`` that fails for the batch holding index ``bad``."""

    def __init__(self, bad):
        self.bad = bad

    def __call__(self, samples):
        if any(int(s[0]) == self.bad for s in samples):
            raise RuntimeError(f"cannot collate the batch of {self.bad}")
        return np.array([s[0] for s in samples]), np.stack([s[1] for s in samples])


def reference(epoch, n=N, bs=BS, shuffle=False, seed=0):
    """``[(indices, values), ...]`` of one epoch, computed in this process."""
    with Loader(list(range(n)), Faulty(), batch_size=bs, workers=0, shuffle=shuffle, seed=seed) as loader:
        loader.set_epoch(epoch)
        return [(idx.tolist(), vals.copy()) for idx, vals in loader]


def take(batch):
    idx, vals = batch
    return idx.tolist(), vals.copy()


def check_epoch(got, ref, ordered, skipped=()):
    """Exactly once, correct values; in reference order if ``ordered``."""
    ref_values = {i: v for idx, vals in ref for i, v in zip(idx, vals, strict=True)}
    indices = [i for idx, _ in got for i in idx]
    assert sorted(indices) == sorted(set(ref_values) - set(skipped)), "not every index exactly once"
    for idx, vals in got:
        for i, v in zip(idx, vals, strict=True):
            np.testing.assert_array_equal(v, ref_values[i], err_msg=f"wrong value for index {i}")
    if ordered and not skipped:
        assert [idx for idx, _ in got] == [idx for idx, _ in ref]
