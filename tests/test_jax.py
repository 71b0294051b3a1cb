"""procpipe.jax: global jax.Arrays sharded over a mesh, copied ahead, multi-process, resumed through Orbax.

Every scenario runs in its own interpreter (tests/jax_check.py), on CPU with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (4 per process with two): JAX reads the
flag once, at start-up, so setting it here would change (or miss) the rest of the session.
Skipped where JAX is not installed (``pip install procpipe[jax]``); the Orbax ones also
without ``orbax-checkpoint``. CI runs them in its TensorFlow/JAX environment (.ci/run).
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, python_env

CHECK = os.path.join(REPO_ROOT, "tests", "jax_check.py")
N = 96  # tests/jax_check.py's samples

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                reason="procpipe.jax needs jax, which is not installed (pip install procpipe[jax])")
needs_orbax = pytest.mark.skipif(importlib.util.find_spec("orbax") is None,
                                 reason="the Orbax checkpoint args need orbax-checkpoint, which is not installed")


def parse(stdout: str) -> dict:
    checks = {}
    for line in stdout.splitlines():
        if line.startswith("CHECK "):
            _, name, value = line.split(" ", 2)
            checks[name] = json.loads(value)
    return checks


def scenario(*args: str, timeout: float = 150) -> dict:
    """``tests/jax_check.py ARGS`` to completion: its checks."""
    try:
        result = subprocess.run([sys.executable, CHECK, *args], check=False, capture_output=True, text=True,
                                timeout=timeout, cwd=REPO_ROOT, env=python_env(TF_CPP_MIN_LOG_LEVEL="2"))
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"jax_check.py {' '.join(args)} did not finish in {timeout} s:\n{exc.stdout}\n{exc.stderr}")
    checks = parse(result.stdout)
    assert result.returncode == 0 and checks.get("done"), (
        f"jax_check.py {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-4000:]}")
    return checks


@pytest.fixture(scope="module")
def single() -> dict:
    return scenario("single")


def test_global_arrays_equal_the_loaders_numpy_batches(single):
    assert single["types"] == [True, "list"], "x is a jax.Array, the str field stays a list"
    assert single["content_equal"], "every batch's content equals the loader's numpy batch (workers=0)"
    assert single["len"] == 6


def test_sharded_as_asked(single):
    # default: 8 devices on "data", the 16 rows of a batch 2 per device
    assert single["default_sharding"] == [True, "P('data',)", 8, [2, 3]]
    # a (4, 2) mesh, P("data"): 4 row blocks of 4, each replicated over "model"'s 2 devices
    assert single["custom_sharding"] == [True, [4, 3], 4, True]


def test_every_sample_exactly_once_and_one_pass_is_one_epoch(single):
    assert single["every_sample_once"] == {"0": True, "1": True, "4": True}
    assert single["epoch_after_pass"] == 1 and single["epoch_after_second_pass"] == 2
    assert single["second_pass_once"], "the second pass is epoch 1: every sample, in a new order"


def test_pytrees_and_non_array_fields(single):
    assert single["tuple_batch"] == ["tuple", True, ["t0", "t1"], list(range(8))]
    assert single["namedtuple_batch"] == ["Pair", True, [8, 4], "uint8"]
    assert single["array_batch"] == [True, [8, 5]]


def test_state_dict_counts_what_the_loop_took(single):
    held, done_below, epoch = single["state_while_held"]
    assert held >= 4, "the thread held 4 batches ahead (a 5th waiting to be queued) when the state was taken"
    assert (done_below, epoch) == (3, 0), "the state counts the 3 batches the loop took, not those held"
    assert single["resume_exact"] == [True, True], "the resumed epoch is the rest of the uninterrupted one"


def test_clear_errors(single):
    assert single["err_prefetch"].startswith("ValueError: procpipe.jax.iterator: prefetch must be an int >= 0")
    assert single["err_sharding"].startswith("TypeError: procpipe.jax.iterator: sharding must be a jax.sharding")
    assert "must share their first dimension" in single["err_rows"] and "batch['b']: 4" in single["err_rows"]
    assert "rows: 12" in single["err_indivisible"] and "multiple of it" in single["err_indivisible"]
    assert single["shard_single"] is None
    if "err_device" in single:  # (torch installed)
        assert "device='cpu'" in single["err_device"] and "without device=" in single["err_device"]


def test_any_iterable_of_numpy_batches(single):
    assert single["plain_iterable"] == [3, [0, 1, 2], [0, 1, 2]], "each pass over a list is the whole list"


@needs_orbax
def test_orbax_save_mid_epoch_then_restore_in_a_fresh_process(tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = scenario("save", directory)
    assert len(saved["taken"]) == 24, "3 batches of 8 taken when the checkpoint was saved (3 more made ahead)"
    restored = scenario("restore", directory)
    assert restored["params"] == [0.0, 1.0, 2.0, 3.0]
    assert restored["rest"] == saved["uninterrupted"], "the resumed epoch continues exactly, in order"
    assert restored["next_epoch"] == saved["next_epoch"], "and the epoch after it is the uninterrupted run's"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout_s(300)
def test_two_processes_make_the_global_batch_of_one(tmp_path):
    directory = str(tmp_path / "ckpt")
    port = str(_free_port())
    env = python_env(TF_CPP_MIN_LOG_LEVEL="2")
    procs = [subprocess.Popen([sys.executable, CHECK, "multi", str(i), port, directory], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env) for i in range(2)]
    try:
        outputs = [proc.communicate(timeout=180) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail("the two JAX processes did not finish in 180 s:\n" + "\n".join(p.communicate()[1][-3000:]
                                                                                  for p in procs))
    runs = [parse(out) for out, _ in outputs]
    for proc, (out, err), checks in zip(procs, outputs, runs, strict=True):
        assert proc.returncode == 0 and checks.get("done"), f"process failed:\n{out[-3000:]}\n{err[-4000:]}"
    for i, checks in enumerate(runs):
        assert checks["processes"] == [i, 2, 4, 8]
        assert checks["shard"] == [i, 2], "procpipe.jax.shard() is (process_index, process_count)"
        # the global batch: rank 0's 8 rows then rank 1's, as one process makes it from the two ranks'
        # loaders; the same samples as an unsharded loader's batch of 16
        assert checks["global_batches"] == checks["by_one_process"]
        assert [sorted(b) for b in checks["global_batches"]] == checks["unsharded_16"]
        assert "shard=None" in checks["err_shard"] and "shard=procpipe.jax.shard(sharding)" in checks["err_shard"]
        assert "(process 0: 8, process 1: 4)" in checks["err_sizes"]
        assert checks["stage_threads"] == [], "a closed loader's prefetching thread still runs"
    assert runs[0]["global_batches"] == runs[1]["global_batches"]

    if importlib.util.find_spec("orbax") is None:
        return
    # the two processes saved mid-epoch; one process resumes (combine_states): every sample once
    taken = runs[0]["taken_before_save"]
    assert len(taken) == 32
    resumed = scenario("restore1", directory)
    assert resumed["combined"]
    assert sorted(taken + resumed["rest"]) == list(range(N))
