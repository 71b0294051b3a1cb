"""Mistakes a procpipe.torch.DataLoader user makes, told in the DataLoader's words.

Each runs as a user's script in a fresh interpreter (what the user sees is the printed
output): a sample that is None, samples of mismatched shapes, and a dataset holding a socket
while a thread of the program runs (so ``multiprocessing_context=None`` does not fork: the
workers come from the zygote and get the dataset pickled). The first line printed (a worker's
error: the ``RemoteTraceback`` cause, which Python prints first) or the exception's message
names the cause in DataLoader terms (``multiprocessing_context``, ``collate_fn``, the
dataset's ``__getitem__``), never the core Loader's (``start_method=``, ``fn``, "passed to
Loader"). And a failed run prints nothing spurious at exit.
"""

from __future__ import annotations

import textwrap

import pytest
from conftest import run_python

pytest.importorskip("torch", reason="procpipe.torch.DataLoader needs torch: pip install procpipe[torch]")

DATASET = textwrap.dedent("""
    import socket, sys, threading
    import numpy as np
    import torch
    import procpipe.torch

    class Samples(torch.utils.data.Dataset):
        def __init__(self, mistake):
            self.mistake = mistake
            if mistake == "socket":
                self.conn = socket.socket()  # opened in __init__: it cannot reach a worker that is not forked
        def __len__(self):
            return 8
        def __getitem__(self, i):
            if self.mistake == "none" and i == 5:
                return None  # a forgotten return
            if self.mistake == "shape" and i == 2:
                return np.zeros(4, dtype=np.float32)
            return np.zeros(3, dtype=np.float32)

    mistake = sys.argv[1]
    if mistake == "socket":
        threading.Thread(target=threading.Event().wait, name="metrics", daemon=True).start()
    loader = procpipe.torch.DataLoader(Samples(mistake), batch_size=4, num_workers=2)
    for batch in loader:
        pass
""")

LOADER_WORDS = ("start_method=", "passed to Loader", " in fn", "by dill")


def _run(mistake: str) -> tuple[str, list[str]]:
    result = run_python(["-c", DATASET, mistake], timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    return result.stderr, result.stderr.strip().splitlines()


def _no_loader_words(text: str) -> None:
    said = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("File "))  # not frames
    assert [w for w in LOADER_WORDS if w in said] == [], text


def test_a_sample_that_is_none():
    stderr, lines = _run("none")
    first = lines[0]
    assert first.startswith("procpipe.errors.RemoteTraceback: TypeError in worker "), first
    assert "the dataset's __getitem__ returned None for index 5" in first and "collate_fn" in first
    _no_loader_words(stderr)
    assert "could not be replaced" not in stderr


def test_samples_of_mismatched_shapes():
    stderr, lines = _run("shape")
    first = lines[0]
    assert first.startswith("procpipe.errors.RemoteTraceback: procpipe.errors.CollateError in worker "), first
    assert "index 0 is an array of shape (3,)" in first and "index 2 is an array of shape (4,)" in first
    assert "pass collate_fn=..." in first and "resize/cast them in the dataset's __getitem__" in first
    _no_loader_words(stderr)


def test_an_unpicklable_dataset_while_a_thread_runs():
    stderr, lines = _run("socket")
    message = lines[-1]  # the exception's message, one line: no chain of the pickler's frames above it
    assert len(lines) < 15, stderr
    assert message.startswith("procpipe.errors.ShippingError: procpipe.torch.DataLoader cannot send the dataset")
    assert "an attribute 'conn' holds a socket.socket, which cannot be pickled" in message
    assert "multiprocessing_context=None starts them with 'zygote' because 1 thread(s) not started by procpipe" in message
    assert "'metrics'" in message and "multiprocessing_context='fork'" in message
    _no_loader_words(stderr)


EXIT_AFTER_A_FAILURE = textwrap.dedent("""
    import numpy as np
    import torch
    import procpipe.torch

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            return np.zeros(3)

    batches = iter(procpipe.torch.DataLoader(Samples(), batch_size=4, num_workers=2,
                                             multiprocessing_context="forkserver"))
    next(batches)
    raise RuntimeError("the user's own bug")  # the loader is still open while the interpreter exits
""")


def test_a_failed_run_prints_nothing_spurious_at_exit():
    """multiprocess's exit hook terminates the daemonic workers; the loaders still open are closed
    before it (_consumer/shutdown.py), so no coordinator takes those deaths for crashes and tries to
    replace them from a forkserver whose socket is gone ("could not be replaced ([Errno 2] ...)")."""
    result = run_python(["-c", EXIT_AFTER_A_FAILURE], timeout=180)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "RuntimeError: the user's own bug", result.stderr
    assert "could not be replaced" not in result.stderr and "procpipe:" not in result.stderr, result.stderr
