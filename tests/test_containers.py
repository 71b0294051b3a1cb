"""procpipe where containers put it: a small ``/dev/shm`` (Docker's and Kubernetes' default is 64 MB),
a memory cgroup, a training process SIGKILLed (the OOM killer's way).

A small ``/dev/shm`` is a tmpfs mounted over it in a private mount namespace (``unshare -m`` as root,
``unshare -rm`` otherwise), in which a script runs the case and prints what it saw; where the
machine refuses the namespace, the tests skip, saying so. The workloads are the container
report's: 224x224x3 uint8 images, 2 workers, batches of 64 (9.6 MB) and 256 (38.5 MB), which torch's
DataLoader cannot pass through a 64 MB ``/dev/shm`` (bench/containers.py measures both).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO_ROOT, python_env

UNSHARE = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
MOUNT = 'mount -t tmpfs -o size="$0" tmpfs /dev/shm && exec "$@"'


def _namespaces_refused() -> str | None:
    """Why no private /dev/shm can be mounted here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run([*UNSHARE, "sh", "-c", MOUNT, "1m", "true"], capture_output=True, text=True, timeout=60)
    return None if probe.returncode == 0 else f"{' '.join(UNSHARE)} cannot mount a tmpfs on /dev/shm: {probe.stderr}"


REFUSED = _namespaces_refused()
needs_namespace = pytest.mark.skipif(REFUSED is not None, reason=f"needs a private mount namespace ({REFUSED})")


def in_small_dev_shm(size: str, script: str, *args: str, timeout: float = 600) -> list:
    """Run ``script`` (Python) with its ``/dev/shm`` a ``size`` tmpfs; the JSON lines it printed."""
    done = subprocess.run([*UNSHARE, "sh", "-c", MOUNT, size, sys.executable, "-c", script, *args],
                          capture_output=True, text=True, timeout=timeout, env=python_env(), cwd=REPO_ROOT)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith(("{", "["))]


IMAGES = textwrap.dedent('''
    import json, os, shutil, sys
    import numpy as np

    N = 512  # samples an epoch: 8 batches of 64 (9.6 MB), or 2 of 256 (38.5 MB)
    BASE = np.zeros((224, 224, 3), np.uint8)

    def image(i):
        x = BASE.copy()  # a 224x224x3 image, as a decoded one: a copy of a preloaded array
        x[0, 0, 0] = x[-1, -1, -1] = i % 251
        return x

    def epochs_seen(loader, epochs):
        """Each epoch's indices, as the batches' first and last pixels say, and /dev/shm's use meanwhile."""
        seen, used = [], 0
        for _ in range(epochs):
            got = []
            for batch in loader:
                assert batch.shape[1:] == (224, 224, 3) and batch.dtype == np.uint8, batch.shape
                assert (batch[:, 0, 0, 0] == batch[:, -1, -1, -1]).all()
                got += batch[:, 0, 0, 0].tolist()
                used = max(used, shutil.disk_usage("/dev/shm").used)
            seen.append(got)
        return seen, used
''')

LOADER_CASES = IMAGES + textwrap.dedent('''
    import procpipe

    for batch_size in (64, 256):
        for method in ("auto", "fork", "zygote", "forkserver", "spawn"):
            with procpipe.Loader(list(range(N)), image, batch_size=batch_size, workers=2,
                                 start_method=method) as loader:
                seen, used = epochs_seen(loader, 2)
                started = loader.start_method
            print(json.dumps({"batch": batch_size, "method": method, "started": started, "seen": seen,
                              "dev_shm_used": used, "left": os.listdir("/dev/shm")}), flush=True)
''')


@needs_namespace
@pytest.mark.timeout_s(900)
@pytest.mark.parametrize("size", ["64m", "8m"])
def test_batches_larger_than_dev_shm_under_every_start_method(size):
    results = in_small_dev_shm(size, LOADER_CASES)
    expected = [i % 251 for i in range(512)]
    assert [(r["batch"], r["method"]) for r in results] == [
        (b, m) for b in (64, 256) for m in ("auto", "fork", "zygote", "forkserver", "spawn")]
    for r in results:
        assert r["seen"] == [expected, expected], (r["batch"], r["method"])  # 2 exact epochs, in order
        assert r["dev_shm_used"] < 1 << 20 and r["left"] == [], r  # /dev/shm never held any of it
        assert r["method"] == "auto" or r["started"] == r["method"]


TORCH_CASE = IMAGES + textwrap.dedent('''
    import torch
    import procpipe.torch

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return N
        def __getitem__(self, i):
            return torch.from_numpy(image(i))

    loader = procpipe.torch.DataLoader(Images(), batch_size=256, num_workers=2)
    seen, used = [], 0
    for _ in range(2):
        got = []
        for batch in loader:
            assert isinstance(batch, torch.Tensor) and tuple(batch.shape) == (256, 224, 224, 3)
            got += batch[:, 0, 0, 0].tolist()
            used = max(used, shutil.disk_usage("/dev/shm").used)
        seen.append(got)
    del loader
    print(json.dumps({"seen": seen, "dev_shm_used": used, "left": os.listdir("/dev/shm")}), flush=True)
''')


@needs_namespace
@pytest.mark.timeout_s(600)
def test_the_torch_drop_in_at_batches_where_torchs_dataloader_dies():
    pytest.importorskip("torch", reason="procpipe.torch needs torch (pip install procpipe[torch])")
    result, = in_small_dev_shm("64m", TORCH_CASE)
    expected = [i % 251 for i in range(512)]
    assert result["seen"] == [expected, expected]
    assert result["dev_shm_used"] < 1 << 20 and result["left"] == []


RECORDS_CASE = textwrap.dedent('''
    import json, os, shutil
    import procpipe

    def label(record):
        return record["label"]

    # 100 MB of metadata (100,000 records of a 1 kB path and a label) in a 16 MB /dev/shm
    records = procpipe.Records([{"path": f"{i:07d}" + "x" * 993, "label": i} for i in range(100_000)])
    with procpipe.Loader(records, label, batch_size=1000, workers=2, start_method="forkserver") as loader:
        total = sum(int(b.sum()) for b in loader)
    print(json.dumps({"nbytes": records.nbytes, "last": records[-1]["path"][:7], "total": total,
                      "dev_shm_used": shutil.disk_usage("/dev/shm").used, "left": os.listdir("/dev/shm")}))
''')


@needs_namespace
def test_records_larger_than_dev_shm():
    result, = in_small_dev_shm("16m", RECORDS_CASE)
    assert result["nbytes"] >= 100_000_000 and result["last"] == "0099999"
    assert result["total"] == sum(range(100_000))  # every record, through the workers (forkserver: no fork)
    assert result["dev_shm_used"] < 1 << 20 and result["left"] == []


TRAINING = IMAGES + textwrap.dedent('''
    import procpipe
    loader = procpipe.Loader(list(range(N)), image, batch_size=256, workers=2, start_method=sys.argv[1])
    it = iter(loader)
    next(it)
    print(*loader.worker_pids, flush=True)
    next(it)
    sys.stdin.read()  # until killed, mid-epoch
''')

KILLED_CASE = textwrap.dedent('''
    import json, os, subprocess, sys
    import psutil

    results = []
    for method in ("auto", "forkserver", "spawn"):
        proc = subprocess.Popen([sys.executable, "-c", sys.argv[1], method], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        workers = [int(p) for p in proc.stdout.readline().split()]
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in tree if psutil.pid_exists(p)], timeout=10)
        results.append({"method": method, "workers": workers, "tree": tree,
                        "alive": [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE],
                        "left": os.listdir("/dev/shm")})
    print(json.dumps(results), flush=True)
''')


@needs_namespace
@pytest.mark.timeout_s(600)
def test_a_sigkill_mid_epoch_leaves_no_file_and_no_worker():
    results, = in_small_dev_shm("64m", KILLED_CASE, TRAINING)
    assert [r["method"] for r in results] == ["auto", "forkserver", "spawn"]
    for r in results:
        assert len(r["workers"]) == 2 and set(r["workers"]) <= set(r["tree"]), r
        assert r["alive"] == [] and r["left"] == [], r  # nothing in /dev/shm, no worker within 10 s


# --------------------------------------------------------------------------- a memory cgroup
def _own_cgroup() -> tuple[str, str] | None:
    """``(version, directory)`` of this process's memory cgroup, where one is mounted read-write."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            return "v2", os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        if "memory" in controllers.split(",") and os.path.isdir("/sys/fs/cgroup/memory"):
            return "v1", os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
    return None


def _child_cgroup(limit: int) -> tuple[str, str]:
    """A new memory cgroup under this process's, limited to ``limit`` bytes: ``(directory, limit file)``."""
    own = _own_cgroup()
    if own is None:
        pytest.skip("needs a memory cgroup hierarchy mounted at /sys/fs/cgroup")
    version, parent = own
    child = os.path.join(parent, f"procpipe-test-{secrets.token_hex(4)}")
    limit_file = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    try:
        if version == "v2":
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
        os.mkdir(child)
    except OSError as exc:
        pytest.skip(f"cannot make a child memory cgroup under {parent} ({version}): {exc}")
    try:
        with open(os.path.join(child, limit_file), "w") as f:
            f.write(str(limit))
    except OSError as exc:
        os.rmdir(child)
        pytest.skip(f"cannot limit a child memory cgroup ({child}/{limit_file}): {exc}")
    return child, limit_file


CGROUP_CASE = textwrap.dedent('''
    import json, os, sys
    with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))  # into the small cgroup, before anything is allocated
    import numpy as np
    import procpipe

    def image(i):
        return np.full((224, 224, 3), i % 251, np.uint8)

    out = {}
    try:  # 7 slots of 38.5 MB: more than the cgroup has room for
        procpipe.Loader(list(range(1024)), image, batch_size=256, workers=2, slot_bytes=256 * 224 * 224 * 3)
        out["large"] = "no error"
    except procpipe.SharedMemoryError as exc:
        out["large"] = str(exc)
    with procpipe.Loader(list(range(64)), image, batch_size=8, workers=2) as loader:  # 7 slots of 1.2 MB: fits
        out["small"] = sum(len(b) for b in loader)
    print(json.dumps(out), flush=True)
''')


def test_a_memory_cgroup_too_small_for_the_ring_is_an_error_naming_it():
    limit = 200 * 2**20
    child, _ = _child_cgroup(limit)
    try:
        done = subprocess.run([sys.executable, "-c", CGROUP_CASE, child], capture_output=True, text=True,
                              timeout=300, env=python_env(), cwd=REPO_ROOT)
    finally:
        try:
            os.rmdir(child)
        except OSError:
            pass
    # never an OOM kill (SIGKILL, exit -9): the ring is refused before it is allocated
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    out = json.loads(done.stdout.splitlines()[-1])
    message = out["large"]
    assert message.startswith("procpipe needs 257.2 MiB of memory for 7 ring slots of 36.8 MiB"), message  # (38.5 MB)
    assert f"the memory limit of this process's cgroup (200.0 MiB at {child}" in message, message
    assert "docker run --memory" in message and "prefetch" in message
    assert out["small"] == 64

