"""The zygote (procpipe._worker.zygote): workers forked from a copy of the process made at
``import procpipe``, when ``"auto"`` can no longer fork the process itself.

Each case runs in a fresh interpreter (``run_python``): what the zygote holds depends on
what the process imported and opened before ``import procpipe``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from conftest import python_env, run_python, wait_gone

# A module imported before procpipe, that the dataset does not reference: a worker forked
# from the zygote has it (the zygote is a copy of the process then), one from a forkserver not.
EARLY_MODULE = "marker_imported_early"

FOREIGN_THREAD = textwrap.dedent(f"""
    import os, sys, threading
    print("early output")  # still in the buffer (stdout is a pipe) when procpipe forks the zygote
    r, w = os.pipe()  # a pipe of the program's, open before procpipe is imported
    import {EARLY_MODULE}
    import numpy as np
    import procpipe
    from procpipe._worker import zygote

    stop = threading.Event()
    threading.Thread(target=stop.wait, name="metrics", daemon=True).start()  # a thread of the program's

    def fn(i):
        return np.array([i, "{EARLY_MODULE}" in sys.modules, os.environ.get("ZYGOTE_TEST_ENV") == "set",
                         os.environ.get("OMP_NUM_THREADS") == "1"])

    with procpipe.Loader(list(range(8)), fn, batch_size=4, workers=2,
                         worker_env={{"ZYGOTE_TEST_ENV": "set"}}) as loader:
        batches = [b.tolist() for b in loader]
        method = loader.start_method
    pid = zygote.pid()
    ours = os.readlink(f"/proc/self/fd/{{w}}")
    theirs = [os.readlink(f"/proc/{{pid}}/fd/{{fd}}") for fd in os.listdir(f"/proc/{{pid}}/fd")]
    print(method)
    print(batches)
    print(ours in theirs, os.path.exists(f"/proc/{{pid}}/fd/{{w}}"))
    with open(f"/proc/{{pid}}/comm") as f:
        print(f.read().strip())
""")


def test_with_a_foreign_thread_auto_forks_workers_from_the_zygote(tmp_path):
    (tmp_path / f"{EARLY_MODULE}.py").write_text("VALUE = 1\n")
    result = run_python(["-W", "error::UserWarning", "-c", FOREIGN_THREAD], timeout=120, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    early, method, batches, fds, name = result.stdout.strip().splitlines()
    assert early == "early output"  # once: no worker wrote out a copy of the buffer
    assert method == "zygote"  # no SlowStartWarning either (-W error)
    # the early module is in each worker; worker_env and the default env are applied
    assert batches == str([[[i, 1, 1, 1] for i in range(4)], [[i, 1, 1, 1] for i in range(4, 8)]])
    # the zygote holds the descriptor's number (to /dev/null), not the program's pipe
    assert fds == "False True"
    assert name == "procpipe-zygote"


NO_ZYGOTE = textwrap.dedent("""
    import threading, warnings
    import procpipe
    from procpipe._worker import zygote
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with procpipe.Loader(list(range(4)), batch_size=2, workers=1) as loader:
            print(loader.start_method, zygote.pid(), sum(len(b) for b in loader))
""")


def test_without_a_zygote_auto_falls_back_to_the_forkserver():
    result = subprocess.run([sys.executable, "-c", NO_ZYGOTE], capture_output=True, text=True, timeout=120, check=False,
                            env=python_env(PROCPIPE_ZYGOTE="0"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["forkserver", "None", "4"]


VALUE_DATASET = textwrap.dedent("""
    import multiprocessing, threading
    import numpy as np
    import procpipe

    class Counted:
        def __init__(self):
            self.count = multiprocessing.Value("i", 0)
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return np.int64(i)

    threading.Thread(target=threading.Event().wait, daemon=True).start()
    try:
        procpipe.Loader(Counted(), batch_size=2, workers=1)
    except TypeError as exc:
        print(exc)
""")


def test_a_dataset_that_only_inheritance_can_pass_names_the_cause_and_the_fix():
    result = run_python(["-c", VALUE_DATASET], timeout=120)
    assert result.returncode == 0, result.stderr
    message = result.stdout
    assert "start_method='auto' starts them with 'zygote' because 1 thread(s) not started by procpipe" in message
    assert "multiprocessing synchronization object" in message and "start_method='fork'" in message


PARENT = textwrap.dedent("""
    import sys
    import procpipe
    from procpipe._worker import zygote
    print(zygote.pid(), flush=True)
    sys.stdin.read()  # until killed
""")


def test_the_zygote_exits_when_the_training_process_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=python_env())
    try:
        pid = int(parent.stdout.readline())
        assert os.path.exists(f"/proc/{pid}")
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        parent.stdin.close()
        parent.stdout.close()
    assert wait_gone([pid], timeout=30) == [], "the zygote outlived its training process"


SPAWNED = textwrap.dedent("""
    import multiprocess
    import numpy as np
    import procpipe
    from procpipe._worker import zygote

    def rank(queue):  # a training process started by spawn: it re-imports this script
        queue.put(zygote.pid() is not None)

    def fn(i):  # in a worker procpipe spawned: it imports procpipe to unpickle its target
        return np.int64(zygote.pid() is not None)

    if __name__ == "__main__":
        ctx = multiprocess.get_context("spawn")
        queue = ctx.Queue()
        p = ctx.Process(target=rank, args=(queue,))
        p.start()
        print(queue.get(timeout=60))
        p.join(60)
        with procpipe.Loader(list(range(2)), fn, batch_size=2, workers=1, start_method="spawn") as loader:
            print(bool(next(iter(loader)).any()))
""")


def test_a_spawned_training_process_gets_a_zygote_and_a_spawned_worker_does_not(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SPAWNED)
    result = run_python([str(script)], timeout=120, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


DATA_MODULE = textwrap.dedent("""
    import numpy as np
    import procpipe  # the zygote is forked here: this module's import is not finished yet

    class Squares:  # defined after the fork: the zygote's copy of this module lacks it
        def __len__(self):
            return 4
        def __getitem__(self, i):
            import sys
            assert sys.modules["procpipe._worker"] is procpipe._worker  # the package imported afresh, linked
            return np.int64(i * i)
""")

MAIN_IMPORTING_IT = textwrap.dedent("""
    import threading
    import mydata  # imports procpipe at its top
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    with mydata.procpipe.Loader(mydata.Squares(), batch_size=2, workers=2) as loader:
        print(loader.start_method, [b.tolist() for b in loader])
""")


def test_a_module_that_imports_procpipe_at_its_top_is_imported_whole_in_the_workers(tmp_path):
    (tmp_path / "mydata.py").write_text(DATA_MODULE)
    result = run_python(["-c", MAIN_IMPORTING_IT], timeout=120, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "zygote [[0, 1], [4, 9]]"
