"""The user's own code runs in the workers as it runs in the script, whatever the start method.

Each script of tests/scripts/user_code/ is a training script as users write them: datasets,
functions and classes defined in ``__main__`` (class hierarchies reaching ``typing.Generic``
with the script's ``TypeVar``s, torch's ``Dataset`` as a base, dataclasses, enums, closures,
``functools.partial``, lambdas in class attributes, classes defined after ``import procpipe``
and after a thread started, a helper module imported late, nested classes, an
``IterableDataset``, a ``collate_fn`` and ``worker_init_fn``, samples that are instances of a
``__main__`` class, which must come back as the script's very class). Each runs as
``python SCRIPT.py METHOD`` in a fresh interpreter, under each of the four start methods, and
loads every pattern through ``procpipe.Loader`` (against the script's own serial output) and
``procpipe.torch.DataLoader`` with ``multiprocessing_context=METHOD`` (against torch's
DataLoader on the same script: corpus.py says under which start method). One subprocess per
(script, method) runs all of that script's patterns: the corpus costs 12 interpreters (18
patterns x 4 start methods x 2 front ends).
"""

from __future__ import annotations

import glob
import json
import os
import pickle
import signal
import textwrap

import numpy as np
import pytest
from conftest import (
    REPO_ROOT,
    loader_token,
    run_python,
    segment_fds,
    to_py,
)

import procpipe
from procpipe import Loader

pytest.importorskip("torch", reason="the corpus compares with torch's DataLoader: pip install procpipe[torch]")
pytest.importorskip("tqdm", reason="a tqdm bar runs in the corpus (a dependency of procpipe)")

SCRIPTS = os.path.join(REPO_ROOT, "tests", "scripts", "user_code")
METHODS = ("fork", "zygote", "forkserver", "spawn")
# The patterns each script must report (a pattern that stops reporting fails the test too).
PATTERNS = {
    "hierarchy": ["generic_typevar_hierarchy", "torch_dataset_base_hierarchy", "subscripted_generic_mixin",
                  "abstract_three_levels", "init_subclass_registry"],
    "values": ["dataclass", "enum_identity", "closure", "functools_partial", "lambda_class_attributes",
               "namedtuple_samples_and_globals", "main_class_samples"],
    "late": ["late_classes_and_helper_module", "nested_classes", "iterable_generic_script_base",
             "collate_fn_and_worker_init_fn"],
}


def _failure(pattern: str, front: str, result: dict) -> str:
    return f"{pattern} through {front}: {result.get('error')}\n{result.get('traceback', '')}"


@pytest.mark.timeout_s(540)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("script", sorted(PATTERNS))
def test_the_scripts_code_runs_in_the_workers_as_in_the_script(script, method):
    result = run_python([os.path.join(SCRIPTS, f"{script}.py"), method], timeout=500, cwd=SCRIPTS)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    if script == "hierarchy" and method == "zygote":
        # the case: a tqdm bar's monitor thread runs, so "auto" forks workers from the zygote
        assert lines.pop(0) == "auto: zygote [[0, 10, 20, 30], [40, 50, 60, 70]]"
    reports = [json.loads(line) for line in lines]
    assert [r["pattern"] for r in reports] == PATTERNS[script]
    failures = [_failure(r["pattern"], front, r[front]) for r in reports
                for front in ("facade", "loader", "expected", "torch") if front in r and "error" in r[front]]
    assert failures == [], "\n".join(failures)
    for r in reports:
        if "loader" in r:
            assert r["loader"]["batches"] == r["expected"]["batches"], r["pattern"]
        assert r["facade"]["batches"] == r["torch"]["batches"], r["pattern"]
        assert r["facade_method"] == method, r["pattern"]


# --------------------------------------------------------------------------- user code, start methods
SCALE = 3


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_lambdas_closures_and_local_classes_with_each_start_method(start_method):
    offset = 100

    class Local:  # defined in a function: cannot be pickled by reference
        def __len__(self):
            return 11

        def __getitem__(self, i):
            return i + offset

    def closure(v):
        return {"v": np.int64(v * SCALE), "r": procpipe.sample_rng().random()}

    kwargs = dict(batch_size=3, collate_fn=lambda s: {"v": np.array([x["v"] for x in s]), "r": [x["r"] for x in s]})
    with Loader(Local(), closure, workers=0, **kwargs) as ref:
        want = [to_py(b) for b in ref]
    with Loader(Local(), closure, workers=2, start_method=start_method, **kwargs) as loader:
        got = [to_py(b) for b in loader]
        got_again = [to_py(b) for b in loader]
        pids = loader.worker_pids
    assert got == want and got_again[0]["v"] == want[0]["v"]
    assert [v for b in got for v in b["v"][1]] == [(i + offset) * SCALE for i in range(11)]
    assert len(set(pids)) == 2 and os.getpid() not in pids


MAIN_SCRIPT = textwrap.dedent('''
    import json
    import sys

    import numpy as np
    import procpipe

    SCALE = 3


    class Squares:
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return i * i


    class AddNoise:
        def __init__(self, k):
            self.k = k

        def __call__(self, v):
            return {"v": v * SCALE + self.k, "r": float(procpipe.sample_rng().random())}


    def make_collate(tag):
        def collate(samples):
            return {"v": np.array([s["v"] for s in samples]), "r": np.array([s["r"] for s in samples]), "tag": tag}
        return collate


    def run(method, workers):
        noise = AddNoise(1)
        out = []
        with procpipe.Loader(Squares(), lambda v: noise(v), batch_size=5, workers=workers,
                             collate_fn=make_collate("t"), start_method=method, shuffle=True, seed=7) as loader:
            for _ in range(2):
                for b in loader:
                    out.append([b["v"].tolist(), b["r"].tolist(), b["tag"]])
            pids = loader.worker_pids
        return out, pids


    if __name__ == "__main__":
        method = sys.argv[1]
        got, pids = run(method, 2)
        want, _ = run(method, 0)
        print(json.dumps({"got": got, "want": want, "pids": pids}))
''')


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_code_defined_in_main_script(tmp_path, start_method):
    script = tmp_path / "train.py"
    script.write_text(MAIN_SCRIPT)
    proc = run_python([str(script), start_method], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["got"] == out["want"]
    assert len(out["got"]) == 10
    first_epoch = sorted(v for b in out["got"][:5] for v in b[0])
    assert first_epoch == sorted(i * i * 3 + 1 for i in range(24))
    assert all(b[2] == "t" for b in out["got"])
    assert len(set(out["pids"])) == 2


def test_lambda_referencing_a_global_in_python_c():
    code = textwrap.dedent('''
        import numpy as np, procpipe
        OFFSET = 1000
        with procpipe.Loader(list(range(10)), lambda i: np.int64(i + OFFSET), batch_size=4, workers=2) as L:
            print(sum(int(b.sum()) for b in L), len(L.worker_pids))
    ''')
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(sum(range(10)) + 10 * 1000), "2"]


N, BS = 40, 4


def eight(i):
    return np.full(8, i, np.int64)  # 64 bytes a sample: a cache field with no padding


class RunsCode:
    """What someone could put in place of the shipped spec: unpickling it runs code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.parametrize("shm", ["anonymous", "directory"])
def test_no_process_can_change_the_spec_workers_unpickle(shm, shm_dir, tmp_path):
    # The spec (the pickled dataset and functions) has no name to replace, and its memory is sealed:
    # not even a process holding it (a worker) can write, shrink or grow it.
    marker = tmp_path / "ran"
    with Loader(list(range(N)), eight, batch_size=BS, workers=1, start_method="forkserver",
                **({"shm_dir": shm_dir} if shm == "directory" else {})) as loader:
        fd, = segment_fds(loader_token(loader) + "spec")
        data = pickle.dumps(RunsCode(str(marker)))
        for change in (lambda: os.pwrite(fd, data, 0), lambda: os.ftruncate(fd, 1), lambda: os.ftruncate(fd, 1 << 20)):
            with pytest.raises(PermissionError):
                change()
        if shm == "directory":
            assert glob.glob(os.path.join(shm_dir, "*spec*")) == []
        os.kill(loader.worker_pids[0], signal.SIGKILL)  # its replacement loads the spec again
        assert [int(b[0, 0]) for b in loader] == list(range(0, N, BS))
    assert not marker.exists()
