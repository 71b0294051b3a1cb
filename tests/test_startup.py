"""Starting workers in the processes users run (procpipe._worker.fork_safety, start_method, preload).

``start_method="auto"`` forks beside procpipe's own threads (a second loader while the first
iterates), never beside a thread it does not control (one the program started, or a native
pool that was running before procpipe was imported); a forkserver preloads only the modules
the shipped objects reference, in the parent's order, and reports one that fails. The
cases whose outcome depends on the threads of the whole process run in a fresh interpreter
(``run_python``): in this one, earlier tests may have started native pools.
"""
from __future__ import annotations

import json
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
from conftest import run_python

import procpipe
from procpipe._worker import fork_safety, start_method, zygote
from procpipe._worker.index_producer import IndexProducer
from procpipe._worker.spec_shipping import dump_spec, preload_list, referenced_modules
from procpipe._worker.worker_spec import WorkerSpec

SECOND_LOADER_WITH_A_VALUE = textwrap.dedent("""
    import multiprocessing, sys
    import numpy as np
    import procpipe

    class Counted:  # as in PyTorch's own tests: a dataset holding a multiprocessing.Value
        def __init__(self, n):
            self.n, self.count = n, multiprocessing.Value("i", 0)
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            with self.count.get_lock():
                self.count.value += 1
            return np.int64(i)

    first = procpipe.Loader(Counted(16), batch_size=4, workers=2)
    it = iter(first)
    next(it)  # the first loader's coordinator thread runs from here on
    ds = Counted(16)
    with procpipe.Loader(ds, batch_size=4, workers=2) as second:
        got = sorted(int(i) for b in second for i in b)
        method = second.start_method
    rest = sum(len(b) for b in it)
    first.close()
    print(method, got == list(range(16)), ds.count.value, rest)
""")


def test_a_second_loader_over_a_dataset_holding_a_multiprocessing_value_works():
    """The first loader's coordinator thread is procpipe's: the second loader forks too, so its
    workers inherit the Value (a forkserver would refuse to pickle it), as DataLoader's do."""
    result = run_python(["-W", "error::UserWarning", "-c", SECOND_LOADER_WITH_A_VALUE], timeout=120)
    assert result.returncode == 0, result.stderr
    method, complete, count, rest = result.stdout.split()
    assert (method, complete, count, rest) == ("fork", "True", "16", "12")


NATIVE_THREADS_BEFORE_IMPORT = textwrap.dedent("""
    import os, sys
    import numpy, torch
    before = len(os.listdir("/proc/self/task"))
    torch.ones(256, 256) @ torch.ones(256, 256)  # torch's intra-op pool starts its threads
    if len(os.listdir("/proc/self/task")) == before:
        print("no-pool")
        sys.exit()
    import procpipe
    from procpipe._worker import fork_safety, start_method
    print(start_method.resolve("auto", warn=False), fork_safety.why_not_safe() is not None)
""")


def test_native_threads_running_before_procpipe_was_imported_do_not_count_as_safe():
    pytest.importorskip("torch")
    result = run_python(["-c", NATIVE_THREADS_BEFORE_IMPORT], timeout=120)
    assert result.returncode == 0, result.stderr
    if result.stdout.strip() == "no-pool":
        pytest.skip("torch started no intra-op thread here (one CPU, or OMP_NUM_THREADS=1)")
    assert result.stdout.split() == ["forkserver", "True"]


def test_procpipe_threads_are_not_foreign_and_a_users_thread_is():
    with procpipe.Loader(list(range(16)), batch_size=4, workers=1, start_method="fork") as loader:
        it = iter(loader)
        next(it)
        names = {t.name for t in threading.enumerate()}
        assert "procpipe-coordinator" in names
        assert "procpipe-coordinator" not in fork_safety.foreign_threads()
        before = set(fork_safety.foreign_threads())  # other tests' libraries may have left threads (fsspec, tqdm)
        assert not any(name.startswith("procpipe-") for name in before)
        stop = threading.Event()
        user = threading.Thread(target=stop.wait, name="user-metrics-thread")
        user.start()
        try:
            assert set(fork_safety.foreign_threads()) - before == {"user-metrics-thread"}
            assert "user-metrics-thread" in fork_safety.why_not_safe()
        finally:
            stop.set()
            user.join(10)
        assert sum(len(b) for b in it) == 12


def test_a_fork_waits_until_no_procpipe_thread_is_in_native_code():
    inside, release, forked = threading.Event(), threading.Event(), threading.Event()

    def native_work():
        with fork_safety.native_region():
            inside.set()
            release.wait(30)

    def fork_now():
        with fork_safety.forking():
            forked.set()

    worker = fork_safety.start_thread(native_work, "procpipe-test-native")
    assert inside.wait(10)
    forker = threading.Thread(target=fork_now)
    forker.start()
    try:
        assert not forked.wait(0.3), "forked while a procpipe thread was in native code"
    finally:
        release.set()
    assert forked.wait(10)
    forker.join(10)
    worker.join(10)


def test_the_slow_start_warning_is_given_once_with_the_reason_and_the_fix(monkeypatch):
    monkeypatch.setattr(start_method, "_warned", False)
    monkeypatch.setattr(zygote, "current", lambda: None)  # no zygote (procpipe imported after threads started)
    stop = threading.Event()
    user = threading.Thread(target=stop.wait, name="user-logging-thread")
    user.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                with procpipe.Loader(list(range(8)), batch_size=4, workers=1) as loader:
                    assert loader.start_method == "forkserver"
                    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
            with procpipe.Loader(list(range(8)), batch_size=4, workers=0):
                pass
    finally:
        stop.set()
        user.join(10)
    slow = [w for w in caught if issubclass(w.category, start_method.SlowStartWarning)]
    assert len(slow) == 1, [str(w.message) for w in caught]
    message = str(slow[0].message)
    assert "user-logging-thread" in message and "start_method='fork'" in message
    assert slow[0].filename == __file__  # points at the user's line


def test_the_forkserver_preloads_what_the_spec_references_in_import_order():
    spec = WorkerSpec(source=np.arange(4), producer=IndexProducer(np.arange(4)),
                      fn=lambda x: json.dumps(int(x)),  # by value: its globals too
                      collate_fn=None, batched=True, seed=0)
    data, _ = dump_spec(spec)
    assert "json" in referenced_modules(data)
    names = preload_list(data)
    order = list(sys.modules)
    assert names == sorted(names, key=order.index), "not in the parent's import order"
    assert "json" in names and "torch" not in names and "tensorflow" not in names
    assert "pytest" not in names  # imported here, not referenced by the spec


FLAKY_MODULE = textwrap.dedent("""
    import os
    if os.environ.get("PROCPIPE_PRELOAD"):  # only in the forkserver, while it preloads
        raise ImportError("needs the plugin registry the parent set up first")

    def double(x):
        return x * 2
""")

PRELOAD_FAILURE = textwrap.dedent("""
    import numpy as np
    import procpipe
    import flaky_plugin
    with procpipe.Loader(np.arange(8), flaky_plugin.double, batch_size=4, workers=1,
                         start_method="forkserver") as loader:
        print([b.tolist() for b in loader])
""")


def test_a_module_that_fails_to_preload_is_reported(tmp_path):
    (tmp_path / "flaky_plugin.py").write_text(FLAKY_MODULE)
    result = run_python(["-c", PRELOAD_FAILURE], timeout=120, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[[0, 2, 4, 6], [8, 10, 12, 14]]"  # the worker imported it itself
    assert "PreloadWarning" in result.stderr
    assert "could not preload module 'flaky_plugin'" in result.stderr
    assert "needs the plugin registry the parent set up first" in result.stderr


def test_the_torch_facade_exposes_the_resolved_start_method(monkeypatch):
    torch_facade = pytest.importorskip("procpipe.torch")
    monkeypatch.setattr(start_method, "fork_is_safe", lambda: True)  # this process may run torch's pool by now
    loader = torch_facade.DataLoader(list(range(8)), batch_size=4, num_workers=1)
    try:
        assert loader.start_method == "auto"  # not resolved before the first iteration creates the engine
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert loader.start_method == "fork"
    finally:
        loader.close()


def test_auto_start_method_does_not_fork_a_process_running_threads():
    import threading

    import procpipe._worker.start_method as start_method
    from procpipe._worker import zygote

    # Never fork beside a foreign thread: the zygote made at import (when this process was still
    # safe to fork) where there is one, else the forkserver.
    server = "zygote" if zygote.current() is not None else "forkserver"
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="test-busy-thread")
    thread.start()
    try:
        assert not start_method.fork_is_safe()
        assert start_method.resolve("auto") == server
        with procpipe.Loader(list(range(8)), batch_size=4, workers=1) as loader:
            assert loader.start_method == server  # what its workers were really started with
            assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    finally:
        stop.set()
        thread.join(10)
    assert start_method.resolve("spawn") == "spawn" and start_method.resolve("fork") == "fork"


WORKER_ENV_SCRIPT = r"""
import os
import procpipe


def read_env(i):
    return os.environ.get("PROCPIPE_TEST_FIRST", "unset"), os.environ.get("PROCPIPE_TEST_SECOND", "unset")


if __name__ == "__main__":
    for env in ({"PROCPIPE_TEST_FIRST": "1"}, {"PROCPIPE_TEST_SECOND": "2"}):
        with procpipe.Loader([0, 1], read_env, batch_size=None, workers=1, worker_env=env) as loader:
            print(*sorted(set(loader)), flush=True)
"""


def test_worker_env_of_one_loader_does_not_leak_into_the_next(tmp_path):
    # A fresh process: the forkserver must be started by the first loader for the leak to show.
    script = tmp_path / "worker_env.py"
    script.write_text(WORKER_ENV_SCRIPT)
    result = run_python([str(script)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["('1', 'unset')", "('unset', '2')"]


def _slow_start_message(monkeypatch, make) -> str:
    """The SlowStartWarning ``make()`` gives with a thread of the program running and no zygote."""
    import threading
    import warnings

    from procpipe._worker import start_method, zygote

    monkeypatch.setattr(start_method, "_warned", False)
    monkeypatch.setattr(zygote, "current", lambda: None)  # (procpipe imported after the threads started)
    stop = threading.Event()
    user = threading.Thread(target=stop.wait, name="user-thread")
    user.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
    finally:
        stop.set()
        user.join(10)
    slow = [str(w.message) for w in caught if issubclass(w.category, start_method.SlowStartWarning)]
    assert len(slow) == 1, [str(w.message) for w in caught]
    return slow[0]


def test_slow_start_advice_in_a_notebook_is_one_the_reader_can_follow(monkeypatch) -> None:
    import sys
    import types

    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))  # (as in a Jupyter kernel)

    def make() -> None:
        with procpipe.Loader(list(range(8)), batch_size=4, workers=1) as loader:
            assert len(list(loader)) == 2

    message = _slow_start_message(monkeypatch, make)
    assert "notebook" in message and "kernel's own threads run before the first cell" in message, message
    assert "import procpipe before starting threads" not in message, message  # (not the reader's to do there)
    assert "start_method='fork'" in message and "start_method='forkserver'" in message, message


def test_slow_start_advice_to_a_dataloader_user_names_multiprocessing_context(monkeypatch) -> None:
    pytest.importorskip("torch")
    import procpipe.torch

    def make() -> None:
        assert len(list(procpipe.torch.DataLoader(list(range(8)), batch_size=4, num_workers=1))) == 2

    message = _slow_start_message(monkeypatch, make)
    assert "multiprocessing_context=None starts workers from a forkserver" in message, message
    assert "multiprocessing_context='fork'" in message and "multiprocessing_context='forkserver'" in message
    assert "start_method" not in message, message


_SCIPY_FIRST = r'''
import numpy, scipy.linalg  # SciPy's own OpenBLAS, with a thread pool of its own (Keras on JAX imports it)
scipy.linalg.inv(numpy.eye(64))
import json, os
threads = len(os.listdir("/proc/self/task"))
import procpipe
from procpipe._worker import fork_safety, zygote
print(json.dumps({"threads": threads, "why": fork_safety.why_not_safe(), "zygote": zygote.pid()}))
'''


def test_scipys_blas_pool_keras_on_jax_imports_does_not_keep_procpipe_from_forking(tmp_path) -> None:
    pytest.importorskip("scipy")
    import json

    from conftest import run_python

    script = tmp_path / "scipy_first.py"
    script.write_text(_SCIPY_FIRST)
    out = run_python(["-W", "error::UserWarning", str(script)])
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    if info["threads"] < 3:
        pytest.skip("numpy's and SciPy's BLAS pools have no threads on this machine (one CPU): nothing to count")
    assert info["why"] is None and info["zygote"] is not None, info
