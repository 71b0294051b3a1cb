"""Preprocessing on a Ray cluster: the same Loader, its workers on other nodes.

``backend=procpipe.ray.Backend(nodes=2)`` starts one agent per Ray node; each runs
``workers`` procpipe worker processes there (here 1), and whole batches come back through
Ray's object store. The sampler, the ordering, ``state_dict`` and everything else stay in
this process, so a cluster loader and a local one give the same batches: this script
checks it by taking a ``state_dict`` mid-epoch on the cluster and resuming it on a local
loader.

Without ``--address`` it starts a small cluster on this machine (a head that runs no task
and two one-CPU nodes: about 15 s), as the tests do; on a real cluster, pass its address
(``ray start --head`` on one machine, ``ray start --address=<head>:6379`` on the others;
procpipe and this script's dependencies installed on every node).

Run: python examples/ray_cluster.py [--address HOST:PORT]
"""
import argparse
import os
import time

import numpy as np

import procpipe

LABELS = ("cat", "dog", "bird")


def preprocess(i):
    """Existing per-record preprocessing: a dict out, with a string, an array and a label."""
    rng = procpipe.sample_rng()  # per-sample generator: the same values on any node
    return {
        "id": f"rec-{i:04d}",
        "features": (np.arange(8, dtype=np.float32) * i + rng.normal(0, 0.1, 8)).astype(np.float32),
        "label": i % len(LABELS),
    }


def as_lists(batches):
    return [{k: (v.tolist() if hasattr(v, "tolist") else list(v)) for k, v in b.items()} for b in batches]


def connect(address):
    """Join the cluster at ``address``, or start a local one (returned, to shut it down)."""
    import ray

    if address:
        ray.init(address=address, log_to_driver=False)
        return None
    from ray.cluster_utils import Cluster

    # The nodes import procpipe: on a real cluster it is installed there; here, from this checkout.
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 100 * 2**20})
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=100 * 2**20)
    cluster.wait_for_nodes(timeout=120)
    ray.init(address=cluster.address, log_to_driver=False)
    print("local cluster: a head (0 CPUs) and 2 nodes of 1 CPU")
    return cluster


def main(address=None):
    import ray

    import procpipe.ray

    cluster = connect(address)
    try:
        kwargs = dict(batch_size=16, shuffle=True, seed=7)
        loader = procpipe.Loader(range(320), preprocess, workers=1, backend=procpipe.ray.Backend(nodes=2), **kwargs)
        with loader:
            for epoch in range(2):
                started, batches = time.perf_counter(), 0
                for batch in loader:
                    batches += 1
                print(f"epoch {epoch}: {batches} batches, {batches / (time.perf_counter() - started):.0f} batches/s; "
                      f"keys {sorted(batch)}, features {batch['features'].dtype} {tuple(batch['features'].shape)}")
            agents = loader.stats()["backend"]["agents"]
            nodes = {a["node"] for a in agents}
            print(f"agents: {len(agents)} on {len(nodes)} nodes")
            for a in agents:
                print(f"  agent {a['number']}: node {a['node'][:12]}, pid {a['pid']}, ready {a['ready']}")

            it = iter(loader)  # a third epoch, interrupted: its state, then the rest of it
            head = [next(it) for _ in range(5)]
            state = loader.state_dict()
            rest = as_lists(it)
        print(f"state_dict after {len(head)} batches of epoch {state['epoch']}; the cluster then gave {len(rest)} more")

        with procpipe.Loader(range(320), preprocess, workers=2, **kwargs) as local:  # no cluster needed
            local.load_state_dict(state)
            resumed = as_lists(local)
        print(f"resumed on a local loader (workers=2): {len(resumed)} batches, "
              f"identical to the cluster's: {'yes' if resumed == rest else 'NO'}")
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    print("closed: loaders, agents and cluster")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="procpipe on a Ray cluster")
    parser.add_argument("--address", help="a running Ray cluster (default: start a local one)")
    main(parser.parse_args().address)
