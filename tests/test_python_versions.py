"""What differs between the Pythons procpipe supports (3.10 to 3.13; CI runs this file on 3.10, 3.11 and 3.13).

- CPython 3.12+ warns after every fork of a multi-threaded process (``DeprecationWarning``: "This
  process (pid=...) is multi-threaded, use of fork() may lead to deadlocks in the child"). procpipe
  forks beside its own threads (an earlier loader's coordinator, the coordinator replacing a worker),
  which it parks first (``procpipe._worker.fork_safety``): those forks must not warn, while the
  program's own forks still do.
- Python 3.14 makes ``forkserver`` multiprocessing's default start method on Linux: procpipe picks
  its own (``start_method="auto"``), whatever multiprocessing's default is.

Each case runs in a fresh interpreter: pytest-xdist's worker runs threads of its own, and the
warnings filters are process-wide.

CPython raises nothing for this warning under ``-W error`` (os.fork clears the exception it would
be), so the scripts record it ("always", at the front of the filters) instead of turning it into
an error; every other warning is an error there.
"""
from __future__ import annotations

import re
import sys
import textwrap

import pytest
from conftest import REPO_ROOT, run_python

FORK_WARNING = "multi-threaded, use of fork()"
RECORDING = textwrap.dedent('''
    import warnings
    warnings.simplefilter("error")  # any other warning fails the script
    warnings.filterwarnings("always", message=r"This process \\(pid=", category=DeprecationWarning)  # recorded
    caught = warnings.catch_warnings(record=True)
    fork_warnings = caught.__enter__()

    def said():
        return [f"{w.filename}:{w.lineno}: {w.message}" for w in fork_warnings if "use of fork()" in str(w.message)]
''')

TWO_LOADERS_AND_A_REPLACEMENT = RECORDING + textwrap.dedent('''
    import os, signal
    import numpy as np
    import procpipe

    def square(i):
        return np.full(4, i * i)

    with procpipe.Loader(list(range(64)), square, batch_size=4, workers=2) as first:
        assert first.start_method == "fork", first.start_method
        it = iter(first)
        next(it)
        victim = first.worker_pids[0]
        os.kill(victim, signal.SIGKILL)  # the coordinator thread forks its replacement
        assert sum(1 for _ in it) == 15
        assert first.stats()["worker_deaths"] == 1 and victim not in first.worker_pids
        with procpipe.Loader(list(range(32)), square, batch_size=4, workers=2) as second:  # beside first's threads
            assert second.start_method == "fork", second.start_method
            assert sum(len(b) for b in second) == 32
    print(said())
''')

PROGRAMS_OWN_FORKS = RECORDING + textwrap.dedent('''
    import os, threading
    import numpy as np
    import procpipe

    with procpipe.Loader(list(range(16)), np.float32, batch_size=4, workers=2) as loader:
        assert sum(len(b) for b in loader) == 16
        child = os.fork()  # the program's own fork, beside the loader's coordinator thread
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
    own = said()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)  # a thread of the program's: forking beside it is not safe
    thread.start()
    try:
        with procpipe.Loader(list(range(16)), np.float32, batch_size=4, workers=1, start_method="fork") as loader:
            assert sum(len(b) for b in loader) == 16
    finally:
        stop.set()
        thread.join()
    print([len(own), len(said()) - len(own)])
''')


def _last_line(script: str, tmp_path) -> str:
    path = tmp_path / "script.py"
    path.write_text(script)
    done = run_python([str(path)], timeout=120, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_procpipes_forks_do_not_warn_two_loaders_and_a_worker_replacement(tmp_path):
    # On 3.12+, before fork_safety silenced it: three warnings (the replacement, the second
    # loader's two workers). On 3.10 and 3.11 CPython never warns: the test passes there too.
    assert _last_line(TWO_LOADERS_AND_A_REPLACEMENT, tmp_path) == "[]"


@pytest.mark.skipif(sys.version_info < (3, 12), reason="CPython warns about forks in threaded processes from 3.12")
def test_the_programs_own_forks_still_warn(tmp_path):
    # its os.fork() beside a loader's threads: one warning; start_method="fork" forced beside a
    # thread of the program's: one per worker (procpipe silences only forks it knows are safe)
    assert _last_line(PROGRAMS_OWN_FORKS, tmp_path) == "[1, 1]"


def test_the_readme_quick_start_runs_with_deprecation_warnings_as_errors(tmp_path):
    with open(f"{REPO_ROOT}/README.md") as f:
        readme = f.read()
    quick_start = re.search(r"## Quick start\s+```python\n(.*?)```", readme, re.S)
    assert quick_start, "README.md has no ## Quick start with a python block"
    path = tmp_path / "quick_start.py"
    path.write_text(quick_start.group(1))
    # error for every DeprecationWarning; "always" (shown) for the fork one, which -W error cannot raise
    done = run_python(["-W", "error::DeprecationWarning", "-W", "always:This process (pid=:DeprecationWarning",
                       str(path)], timeout=120, cwd=str(tmp_path))
    assert done.returncode == 0 and FORK_WARNING not in done.stderr, done.stderr


@pytest.mark.parametrize("default", ["forkserver", "spawn"])
def test_procpipe_picks_its_own_start_method_whatever_multiprocessings_default(tmp_path, default):
    # Python 3.14 makes forkserver multiprocessing's default on Linux; a program may set it too.
    script = textwrap.dedent(f'''
        import multiprocessing, multiprocess, os
        import psutil
        multiprocessing.set_start_method({default!r})
        multiprocess.set_start_method({default!r})
        import procpipe
        with procpipe.Loader(list(range(8)), abs, batch_size=2, workers=2) as loader:
            parents = {{psutil.Process(p).ppid() for p in loader.worker_pids}}
            print(loader.start_method, parents == {{os.getpid()}}, sum(len(b) for b in loader))
    ''')
    assert _last_line(script, tmp_path) == "fork True 8"
