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

import json
import os

import pytest
from conftest import REPO_ROOT, run_python

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
