"""procpipe on a Ray cluster (``procpipe.ray``), on a local multi-node cluster.

One ``ray.cluster_utils.Cluster`` per module: a head that runs no task (``num_cpus=0``: the
training process's node) and three one-CPU nodes, each agent taking one. Every node is a
set of processes on this machine, with its own raylet and object store.

The cluster's own processes (raylets, Ray's idle worker pool) are descendants of this test
process, so the suite-wide leak check is replaced here by a precise one: the agents'
processes and their procpipe workers are gone after ``close()`` (and after the cluster
shuts down), and no ``/dev/shm`` file of theirs or of this process is left.
"""
from __future__ import annotations

import glob
import os
import signal
import textwrap
import time

import numpy as np
import psutil
import pytest

from conftest import REPO_ROOT, our_shm_files, run_python, wait_until
from faultkit import SlowToLoad, first_attempt

ray = pytest.importorskip("ray", reason="the Ray backend's tests need ray (pip install procpipe[ray])")
from ray.cluster_utils import Cluster  # noqa: E402

import procpipe  # noqa: E402
import procpipe.ray  # noqa: E402
from procpipe import Loader, Shards  # noqa: E402

# leaks: checked precisely below. xdist_group: under pytest-xdist (`-n 2 --dist loadgroup`) one
# worker runs every test that starts a Ray cluster, one after another (one cluster at a time).
pytestmark = [pytest.mark.allow_leaks, pytest.mark.timeout_s(300), pytest.mark.xdist_group("ray")]

NODE_STORE = 100 * 2**20  # object store per node


@pytest.fixture(scope="module")
def cluster():
    # The nodes must import what the loaders here ship by reference: procpipe (from this
    # checkout, installed or not) and this module's functions, as on a real cluster the
    # user's modules must be installed (or given to Ray's runtime_env) on every node.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests"), saved or ""])
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": NODE_STORE})
    for _ in range(3):
        c.add_node(num_cpus=1, object_store_memory=NODE_STORE)
    c.wait_for_nodes(timeout=120)
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


# --------------------------------------------------------------------------- data
N = 60


def sample(i):
    """Distinct per index and per draw of sample_rng(): a batch differing anywhere shows."""
    return {"x": np.full(3, i, np.float32) + procpipe.sample_rng().random(3).astype(np.float32), "i": i}


def open_shard(path):
    start = int(path)
    return iter(range(start, start + 10))


SHARDS = [str(k * 10) for k in range(6)]


def record(r):
    return {"x": np.full(2, r, np.int64), "i": r}


def make(kind, **kw):
    if kind == "indexed":
        return Loader(range(N), sample, batch_size=4, shuffle=True, seed=3, **kw)
    return Loader(Shards(SHARDS, open_shard, cycle_length=2, block_length=4), record, batch_size=4, seed=3, **kw)


def as_lists(batches):
    return [{k: v.tolist() for k, v in b.items()} for b in batches]


def key(batch):
    return tuple(batch["i"])


def by_record(batches):
    """Every record's values, in record order (a multiset: a record once per epoch; one
    twice, or missing, shows against workers=0's)."""
    return sorted((i, x) for b in batches for i, x in zip(b["i"], b["x"], strict=True))


def agent_processes(loader):
    """The agents' files prefixes (None: their shared memory is anonymous, nothing to leave), and
    their processes with every procpipe worker under them (this machine is every node)."""
    agents = [a for a in loader.stats()["backend"]["agents"] if a is not None and a["alive"]]
    procs = []
    for agent in agents:
        p = psutil.Process(agent["pid"])
        procs += [p, *p.children(recursive=True)]
    return [a["files"] for a in agents], procs


def assert_agents_cleaned(prefixes, procs, timeout=30):
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"agent processes left: {alive}"
    left = [f for prefix in prefixes if prefix is not None for f in glob.glob(prefix + "*")]
    assert not left, f"agent files left: {left}"


# --------------------------------------------------------------------------- same batches
@pytest.mark.parametrize("kind", ["indexed", "shards"])
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "sloppy"])
def test_same_batches_as_workers_0_over_two_epochs(cluster, kind, ordered, shm_dir):
    files_before = our_shm_files()
    with make(kind, workers=0, epochs=2, ordered=ordered) as local:
        expected = as_lists(local)
    # (sloppy: the agents' rings in files of an shm_dir, removed with them; ordered: anonymous memory)
    with make(kind, workers=1, epochs=2, ordered=ordered, backend=procpipe.ray.Backend(nodes=2),
              **({} if ordered else {"shm_dir": shm_dir})) as loader:
        prefixes, procs = agent_processes(loader)
        assert all(p is None for p in prefixes) if ordered else all(prefixes)
        assert len(prefixes) == 2 and len({a.node_id for a in loader._coordinator.pool.agents}) == 2  # two nodes
        got = as_lists(loader)
    if ordered:
        assert got == expected
    elif kind == "indexed":  # sloppy: the same batches, in the order they finished
        assert sorted(got, key=key) == sorted(expected, key=key)
    else:  # a sloppy stream batches records as their blocks arrive: the same records, the same values
        assert by_record(got) == by_record(expected)
    assert_agents_cleaned(prefixes, procs)
    assert our_shm_files() == files_before


def plain(i):
    """``sample`` without its draws: what a cached stage may be (deterministic)."""
    return {"x": np.full(3, i, np.float32), "i": i}


@pytest.mark.parametrize("kind", ["indexed", "shards"])
def test_each_agent_opens_its_own_cache(cluster, kind):
    """``cache=``: each agent opens its cache on its node (cache.py ``open_cache``, before its pool;
    a stream without lengths: the growing one), none in this process; the batches are workers=0's."""
    files_before = our_shm_files()
    source = range(N) if kind == "indexed" else Shards(SHARDS, open_shard, cycle_length=2, block_length=4)
    fn = plain if kind == "indexed" else record
    with Loader(source, fn, batch_size=4, seed=3, epochs=2, cache=True, workers=0) as local:
        expected = as_lists(local)
    with Loader(source, fn, batch_size=4, seed=3, epochs=2, cache=True, workers=1,
                backend=procpipe.ray.Backend(nodes=2)) as loader:
        prefixes, procs = agent_processes(loader)
        got = as_lists(loader)
        assert loader.cache_info() is None  # (the caches are the agents', on their nodes)
    assert got == expected
    assert_agents_cleaned(prefixes, procs)
    assert our_shm_files() == files_before


# --------------------------------------------------------------------------- faults
class DieOnce:
    """``sample``, except that the worker loading index ``at`` dies the first time (a marker file)."""

    def __init__(self, marks, at):
        self.marks, self.at = str(marks), at

    def __call__(self, i):
        if i == self.at and first_attempt(self.marks, "died"):
            os._exit(9)
        return sample(i)


def test_a_worker_process_dying_in_an_agent_is_rerun(cluster, tmp_path):
    with Loader(range(N), sample, batch_size=4, workers=0, epochs=2) as local:
        expected = as_lists(local)
    with Loader(range(N), DieOnce(tmp_path, 17), batch_size=4, workers=1,
                backend=procpipe.ray.Backend(nodes=2)) as loader:
        first = as_lists(loader)
        assert loader.stats()["worker_deaths"] == 1
        assert first + as_lists(loader) == expected  # the lane's new process serves the next epoch


class Slow:
    def __call__(self, i):
        time.sleep(0.02)
        return sample(i)


@pytest.mark.parametrize("how", ["agent SIGKILLed", "node removed"])
def test_a_lost_agent_changes_nothing(cluster, how, shm_dir):
    with Loader(range(N), sample, batch_size=4, workers=0, epochs=2) as local:
        expected = as_lists(local)
    backend = procpipe.ray.Backend(nodes=2, node_timeout=5.0)
    # (its agents' rings in files of an shm_dir: a lost agent's workers remove them)
    with Loader(range(N), Slow(), batch_size=4, workers=1, epochs=2, backend=backend, shm_dir=shm_dir) as loader:
        pool = loader._coordinator.pool
        it = iter(loader)
        got = [next(it) for _ in range(3)]
        victim = pool.agents[0]
        if how == "agent SIGKILLed":
            os.kill(victim.pid, signal.SIGKILL)
        else:
            node = next(n for n in cluster.worker_nodes if n.node_id == victim.node_id)
            cluster.remove_node(node, allow_graceful=False)
        got += list(it)
        assert as_lists(got) == expected  # every batch once, in order, the same values
        assert pool.restarts == 1 and pool.agents[0] is not victim
        # the lost agent's workers saw it gone, removed its files and exited (Ray kills its process group)
        assert victim.files_prefix
        wait_until(lambda: not glob.glob(victim.files_prefix + "*"), 30, "the lost agent's files removed")
        # the other agent ran the lost one's batches meanwhile: the epoch may end before its
        # replacement is ready, which follows
        def agent_0_events():
            return [what for _, what, number, _ in loader.stats()["backend"]["events"] if number == 0]

        wait_until(lambda: agent_0_events()[-1] == "ready", 60, "the replacement agent ready")
        assert agent_0_events()[-3:] == ["lost", "replacing", "ready"]
        assert loader.stats()["backend"]["restarts"] == 1
    if how == "node removed":
        cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE)  # for the tests after this one
        cluster.wait_for_nodes(timeout=120)


def test_a_silent_agent_is_declared_lost_after_node_timeout(cluster):
    """An agent that stops answering without any error (SIGSTOP: as a node cut off the network)
    is lost after node_timeout; its batches run elsewhere, every index once."""
    with Loader(range(N), sample, batch_size=4, workers=0) as local:
        expected = as_lists(local)
    backend = procpipe.ray.Backend(nodes=2, node_timeout=3.0)
    with Loader(range(N), Slow(), batch_size=4, workers=1, backend=backend) as loader:
        it = iter(loader)
        got = [next(it)]
        silent = loader._coordinator.pool.agents[0]
        os.kill(silent.pid, signal.SIGSTOP)
        try:
            got += list(it)
        finally:
            os.kill(silent.pid, signal.SIGCONT)  # (killed by the pool meanwhile; harmless if gone)
        assert as_lists(got) == expected
        lost = [detail for _, what, number, detail in loader.stats()["backend"]["events"] if what == "lost"]
        assert lost and "node_timeout" in lost[0]


def test_past_max_node_restarts_the_epoch_fails_with_the_fix(cluster):
    backend = procpipe.ray.Backend(nodes=1, max_node_restarts=0, node_timeout=5.0)
    with Loader(range(N), Slow(), batch_size=4, workers=1, backend=backend) as loader:
        it = iter(loader)
        next(it)
        os.kill(loader._coordinator.pool.agents[0].pid, signal.SIGKILL)
        with pytest.raises(procpipe.ray.NodeLostError, match="max_node_restarts=0"):
            list(it)


def test_past_max_node_restarts_the_other_agents_finish_the_epoch(cluster, caplog):
    with Loader(range(N), sample, batch_size=4, workers=0) as local:
        expected = as_lists(local)
    backend = procpipe.ray.Backend(nodes=2, max_node_restarts=0, node_timeout=5.0)
    with Loader(range(N), Slow(), batch_size=4, workers=1, backend=backend) as loader:
        it = iter(loader)
        got = [next(it)]
        os.kill(loader._coordinator.pool.agents[0].pid, signal.SIGKILL)
        got += list(it)
        assert as_lists(got) == expected
        assert "could not be replaced" in caplog.text and "max_node_restarts=0" in caplog.text


class Raises:
    def __call__(self, i):
        if i == 9:
            raise KeyError("bad record 9")
        return sample(i)


def test_an_error_in_fn_takes_its_batchs_place_and_the_iteration_goes_on(cluster):
    with Loader(range(N), Raises(), batch_size=4, workers=1, backend=procpipe.ray.Backend(nodes=1)) as loader:
        it = iter(loader)
        got = []
        with pytest.raises(KeyError, match="bad record 9") as info:
            while True:
                got.append(next(it))
        assert "index 9" in "\n".join(info.value.__notes__)
        got += list(it)
        assert sorted(i for b in got for i in b["i"].tolist()) == [i for i in range(N) if not 8 <= i < 12]


# --------------------------------------------------------------------------- resume
@pytest.mark.parametrize("resume_on", ["cluster", "local"])
def test_state_dict_mid_epoch_resumes_exactly(cluster, resume_on):
    with make("indexed", workers=0) as local:
        expected = as_lists(local)
    with make("indexed", workers=1, backend=procpipe.ray.Backend(nodes=2)) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(5)]
        state = loader.state_dict()
    kw = {"workers": 1, "backend": procpipe.ray.Backend(nodes=2)} if resume_on == "cluster" else {"workers": 2}
    with make("indexed", **kw) as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed)
    assert as_lists(head) + as_lists(rest) == expected


# --------------------------------------------------------------------------- cleanup
CLUSTER_SHUTDOWN_SCRIPT = textwrap.dedent("""
    import glob, json, os, sys
    import numpy as np, psutil, ray
    from ray.cluster_utils import Cluster
    import procpipe, procpipe.ray

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 100 * 2**20})
    for _ in range(2):
        c.add_node(num_cpus=1, object_store_memory=100 * 2**20)
    c.wait_for_nodes(timeout=120)
    ray.init(address=c.address, log_to_driver=False)
    loader = procpipe.Loader(range(100), lambda i: np.full(4, i), batch_size=4, workers=1,
                             backend=procpipe.ray.Backend(nodes=2))
    it = iter(loader)
    next(it)
    agents = loader.stats()["backend"]["agents"]
    pids, prefixes = [a["pid"] for a in agents], [a["files"] for a in agents]
    procs = [q for pid in pids for q in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]]
    for node in list(c.worker_nodes):  # the cluster goes away under a running loader, never closed
        c.remove_node(node, allow_graceful=False)
    gone, alive = psutil.wait_procs(procs, timeout=30)
    alive = [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    files = [f for prefix in prefixes if prefix for f in glob.glob(prefix + "*")]
    print("RESULT", json.dumps({"workers": len(procs) - len(pids), "alive": alive, "files": files}), flush=True)
    ray.shutdown()
    c.shutdown()
    os._exit(0)
""")


def test_a_cluster_shut_down_under_a_running_loader_leaves_no_process_and_no_file(tmp_path):
    script = tmp_path / "shutdown.py"
    script.write_text(CLUSTER_SHUTDOWN_SCRIPT)
    done = run_python([str(script)], timeout=240)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    import json

    result = json.loads(line[len("RESULT "):])
    assert result["workers"] >= 2  # the agents did run procpipe workers
    assert result["alive"] == [] and result["files"] == []


# --------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(nodes=0), ValueError, r"nodes=\.\.\.\) must be an int >= 1"),
    (dict(max_node_restarts=-1), ValueError, "max_node_restarts"),
    (dict(node_timeout=0), ValueError, "node_timeout"),
    (dict(start_method="fork"), ValueError, "fork is unsafe"),
    (dict(resources={"gpu": -1}), ValueError, "resources"),
])
def test_backend_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        procpipe.ray.Backend(**kwargs)


@pytest.mark.parametrize("workers", [0, "auto"])
def test_a_backend_needs_a_worker_count(workers):
    with pytest.raises(ValueError, match="worker processes per node"):
        Loader(range(8), batch_size=4, workers=workers, backend=procpipe.ray.Backend())


def test_importing_procpipe_does_not_import_ray():
    done = run_python(["-c", "import sys, procpipe; print('ray' in sys.modules)"])
    assert done.stdout.strip() == "False", done.stderr


def test_a_device_stage_takes_batches_from_the_object_store(cluster):
    torch = pytest.importorskip("torch", reason="device= needs torch")
    with Loader(range(N), sample, batch_size=4, workers=0) as local:
        expected = as_lists(local)
    import warnings

    with Loader(range(N), sample, batch_size=4, workers=1, device="cpu",
                backend=procpipe.ray.Backend(nodes=1)) as loader, warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on a tensor over read-only (object store) memory
        got = list(loader)
    assert all(isinstance(b["x"], torch.Tensor) for b in got)
    assert [{k: v.tolist() for k, v in b.items()} for b in got] == expected


def big(i):
    return np.zeros(10 * 2**20, np.uint8)  # 10 MiB a sample: 40 MiB a batch


def test_batches_in_flight_that_do_not_fit_the_object_store_fail_early_with_the_fix(cluster):
    with Loader(range(16), big, batch_size=4, workers=1, backend=procpipe.ray.Backend(nodes=2)) as loader:
        with pytest.raises(procpipe.ray.ObjectStoreError, match="object store holds 100 MiB.*smaller batch_size"):
            list(loader)


class Hangs:
    """``sample``, except that index ``at`` hangs on its first attempt (a marker file)."""

    def __init__(self, marks, at):
        self.marks, self.at = str(marks), at

    def __call__(self, i):
        if i == self.at and first_attempt(self.marks, "hung"):
            time.sleep(600)
        return sample(i)


def test_task_timeout_kills_a_hung_remote_worker_and_reruns_its_batch(cluster, tmp_path):
    with Loader(range(N), sample, batch_size=4, workers=0) as local:
        expected = as_lists(local)
    with Loader(range(N), Hangs(tmp_path, 21), batch_size=4, workers=1, task_timeout=3.0,
                backend=procpipe.ray.Backend(nodes=2)) as loader:
        assert as_lists(loader) == expected
        assert loader.stats()["timed_out_tasks"] == 1


def test_a_lane_killed_while_idle_is_replaced(cluster):
    """A task_timeout kill can land just after the task finished: the lane's process dies idle.
    The agent must still report it, or the lane would never be used nor replaced again."""
    with Loader(range(N), sample, batch_size=4, workers=0, epochs=2) as local:
        expected = as_lists(local)
    with Loader(range(N), sample, batch_size=4, workers=1, backend=procpipe.ray.Backend(nodes=1)) as loader:
        first = as_lists(loader)
        pool = loader._coordinator.pool
        link = pool.links[0]
        pool.kill_lane(link)  # what the watchdog does, on a lane with nothing running
        wait_until(lambda: link.ended, 30, "the idle lane's death reported")
        assert first + as_lists(loader) == expected  # the next epoch runs on its replacement


def test_a_slow_worker_start_on_a_node_is_not_a_task_timeout(cluster):
    with Loader(SlowToLoad(range(16)), batch_size=4, workers=1, task_timeout=1.5,
                backend=procpipe.ray.Backend(nodes=1)) as loader:
        assert [b.tolist() for b in loader] == [list(range(k, k + 4)) for k in range(0, 16, 4)]
        assert loader.stats()["timed_out_tasks"] == 0


def test_a_loader_created_right_after_a_node_was_lost_starts_on_live_nodes(cluster):
    # Ray lists a lost node as alive for seconds: an agent placed there used to die ("The actor
    # died unexpectedly") and the loader failed to start (issue 21.4).
    with Loader(range(N), sample, batch_size=4, workers=0) as local:
        expected = as_lists(local)
    node = sorted(cluster.worker_nodes, key=lambda n: n.node_id)[0]
    lost = node.node_id
    cluster.remove_node(node, allow_graceful=False)
    try:
        backend = procpipe.ray.Backend(nodes=2, node_timeout=5.0, start_timeout=60.0)
        with Loader(range(N), sample, batch_size=4, workers=1, backend=backend) as loader:
            assert as_lists(loader) == expected
            agents = loader.stats()["backend"]["agents"]
            assert all(a["node"] != lost for a in agents) and len({a["node"] for a in agents}) == 2
    finally:
        cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE)  # for the tests after this one
        cluster.wait_for_nodes(timeout=120)


def test_a_node_whose_raylet_refuses_connections_is_not_live():
    from procpipe.ray import cluster

    with __import__("socket").socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert not cluster.raylet_answers({"NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port})
    assert cluster.spare_node([("a", {"CPU": 1}), ("b", {"CPU": 2})], {"CPU": 2}, set()) == "b"
