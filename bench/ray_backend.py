"""The Ray backend beside local workers, on a local multi-node cluster (issue 13).

    python bench/ray_backend.py              # 5 repetitions, about 4 minutes
    python bench/ray_backend.py --reps 3 --quick --faults worker,agent

It starts a ``ray.cluster_utils.Cluster`` on this machine (a head that runs no task, and
two one-CPU nodes, each with its own raylet and object store), then measures two engines
side by side, ALTERNATING them within each repetition (A B, then B A, ...), and prints the
median over the repetitions with its spread (min-max):

- ``local``: ``Loader(..., workers=2)``, worker processes on this machine;
- ``ray``:   ``Loader(..., workers=1, backend=procpipe.ray.Backend(nodes=2))``, one agent
  per node, each running one procpipe worker; batches come back through Ray's object store.

Measures:

========== ===============================================================================
transfer   GB/s of 224x224x3 uint8 batches of 64 (9.6 MB each)
tiny64     microseconds per batch of 64 ints (the engine's cost per batch)
tiny1      the same with batches of 1 int
           (these three: a warm loader, after a warm-up epoch; each timed epoch from its 5th
           batch to its end, so the epoch's start-up is left out)
first      seconds from ``Loader(...)`` to the first batch, a fresh loader each time
recovery   ``Backend(nodes=2, node_timeout=5, start_timeout=30)``, ~10 ms batches: after a few
           batches an agent process is SIGKILLed, or (another row) its node is removed
           (``remove_node(allow_graceful=False)``) and a new node added at once, as an
           autoscaler would; from ``stats()["backend"]["events"]``:
           kill -> "lost" (the error seen), kill -> "ready" (its replacement started),
           kill -> the epoch's last batch; and a check that every index came exactly once.
           The local row kills one worker process instead (kill -> epoch done only).
========== ===============================================================================

What the figures mean: every "node" here is a set of processes on this one machine, sharing
its cores with the training process, the raylets and each other, and the "network" is
loopback. So the ray column is the overhead Ray's actor calls and object store add to each
batch, not the throughput of a real cluster (where each node brings its own CPUs and the
batches cross a real network). Only the ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
NODE_STORE = 200 * 2**20  # object store per node (bytes)
ENGINES = ("local", "ray")
SKIP = 5  # batches of each timed epoch left out of the steady-state figures (the epoch's start-up)


@dataclass
class Sizes:
    transfer_batches: int
    tiny_batches: int
    recovery_batches: int
    kill_after: int = 5


FULL = Sizes(transfer_batches=60, tiny_batches=400, recovery_batches=120)
QUICK = Sizes(transfer_batches=12, tiny_batches=80, recovery_batches=30)


# --------------------------------------------------------------------------- the cluster
def start_cluster(nodes: int) -> Any:
    """A head with no CPUs (the training process's node) and ``nodes`` one-CPU nodes."""
    # The nodes import procpipe from this checkout: PYTHONPATH must say so before they start.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": NODE_STORE})
    for _ in range(nodes):
        cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE)
    cluster.wait_for_nodes(timeout=120)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    return cluster


# --------------------------------------------------------------------------- loaders
def make_loader(engine: str, source: Any, batch_size: int, **kw: Any) -> Any:
    """The same Loader on this machine (2 workers) or on the cluster (2 nodes x 1 worker)."""
    import procpipe

    if engine == "local":
        return procpipe.Loader(source, batch_size=batch_size, workers=2, **kw)
    import procpipe.ray

    backend = kw.pop("backend", None) or procpipe.ray.Backend(nodes=2)
    return procpipe.Loader(source, batch_size=batch_size, workers=1, backend=backend, **kw)


def timed_epoch(loader: Any, skip: int = 0) -> tuple[float, int, int]:
    """(seconds, batches, array bytes) of one epoch from its ``skip``-th batch on (the epoch's
    start-up left out), dropping each batch at once. ``batches`` counts the whole epoch."""
    batches = nbytes = 0
    started = time.perf_counter()
    for batch in loader:
        batches += 1
        if batches == skip:
            started = time.perf_counter()
        elif batches > skip:
            nbytes += batch.nbytes
        del batch
    return time.perf_counter() - started, batches, nbytes


@dataclass
class Series:
    """One figure per repetition, for one measure and one engine."""

    values: list[float] = field(default_factory=list)

    def cell(self, fmt: str) -> str:
        if not self.values:
            return "-"
        med = statistics.median(self.values)
        return f"{fmt.format(med)} [{fmt.format(min(self.values))}-{fmt.format(max(self.values))}]"

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")


def alternate(rep: int) -> tuple[str, ...]:
    """local, ray on even repetitions; ray, local on odd ones."""
    return ENGINES if rep % 2 == 0 else ENGINES[::-1]


# --------------------------------------------------------------------------- steady state
def steady_state(sizes: Sizes, reps: int, results: dict[str, dict[str, Series]]) -> None:
    """transfer GB/s and tiny per-batch cost: one warm loader per engine and workload."""
    from procpipe.bench.workloads import WORKLOADS

    cases = {
        "transfer": WORKLOADS["transfer"].dataset(64 * sizes.transfer_batches),
        "tiny64": WORKLOADS["tiny64"].dataset(64 * sizes.tiny_batches),
        "tiny1": WORKLOADS["tiny1"].dataset(sizes.tiny_batches),
    }
    for name, source in cases.items():
        batch_size = WORKLOADS[name].batch_size
        loaders = {engine: make_loader(engine, source, batch_size) for engine in ENGINES}
        try:
            for engine in ENGINES:
                timed_epoch(loaders[engine])  # warm-up: workers started, ring / object store sized
            for rep in range(reps):
                for engine in alternate(rep):
                    seconds, batches, nbytes = timed_epoch(loaders[engine], SKIP)
                    assert batches == len(source) // batch_size, (name, engine, batches)
                    value = nbytes / seconds / 1e9 if name == "transfer" else seconds / (batches - SKIP) * 1e6
                    results[name][engine].values.append(value)
        finally:
            for loader in loaders.values():
                loader.close()
        print(f"  {name}: done", flush=True)


def first_batch(reps: int, results: dict[str, dict[str, Series]]) -> None:
    """Loader construction + the first next(), a fresh loader each repetition."""
    from procpipe.bench.workloads import WORKLOADS

    source = WORKLOADS["tiny64"].dataset(64 * 20)
    for rep in range(reps):
        for engine in alternate(rep):
            started = time.perf_counter()
            loader = make_loader(engine, source, 64)
            try:
                next(iter(loader))
                results["first"][engine].values.append(time.perf_counter() - started)
            finally:
                loader.close()
    print("  first batch: done", flush=True)


# --------------------------------------------------------------------------- recovery
class EventClock:
    """Watches ``stats()["backend"]["events"]`` from a thread, to put the events on this
    process's clock: an event's own time counts from the pool's start, so the offset is
    ``(when it was first seen) - (its time)``, at most one poll late (the smallest seen)."""

    def __init__(self, loader: Any, every_s: float = 0.005) -> None:
        self.loader = loader
        self.every_s = every_s
        self.offset = float("inf")
        self.events: list[tuple] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self._poll()
            self.stop.wait(self.every_s)

    def _poll(self) -> None:
        backend = self.loader.stats()["backend"]
        now = time.perf_counter()
        events = list(backend["events"]) if backend else []
        for event in events[len(self.events) :]:
            self.offset = min(self.offset, now - event[0])
        self.events = events

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self._poll()

    def first(self, what: str, number: int, after: float) -> float | None:
        """This process's time of the first ``what`` event of agent ``number`` after ``after``."""
        return next(
            (t + self.offset for t, w, n, _ in self.events if w == what and n == number and t + self.offset >= after),
            None,
        )


@dataclass
class Recovery:
    lost: Series = field(default_factory=Series)  # kill -> "lost"
    ready: Series = field(default_factory=Series)  # kill -> "ready"
    done: Series = field(default_factory=Series)  # kill -> epoch done
    exactly_once: list[bool] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # epochs that failed (NodeLostError), why


def slow_source(batches: int) -> Any:
    """About 10 ms per batch of 4 (2.5 ms of sleep per sample), importable on every node."""
    from procpipe.bench.workloads import StragglerDataset

    return StragglerDataset(4 * batches, fast_s=0.0025, slow_s=0.0025)


FAULTS = {  # fault -> (engine, what the report calls it)
    "worker": ("local", "local (a worker process killed)"),
    "agent": ("ray", "ray (an agent process killed)"),
    "node": ("ray", "ray (a node removed, one added)"),
}


def recover_once(fault: str, sizes: Sizes, out: Recovery, cluster: Any) -> None:
    """One epoch with ``fault`` after ``kill_after`` batches: the times after it, and exactly once."""
    import procpipe.ray

    engine = FAULTS[fault][0]
    source = slow_source(sizes.recovery_batches)
    backend = procpipe.ray.Backend(nodes=2, node_timeout=5.0, start_timeout=30.0)
    loader = make_loader(engine, source, 4, shuffle=True, seed=1, **({"backend": backend} if engine == "ray" else {}))
    clock = None
    try:
        it = iter(loader)
        seen = [int(i) for _ in range(sizes.kill_after) for i in next(it)]
        stats = loader.stats()
        if engine == "ray":
            clock = EventClock(loader)
        killed = time.perf_counter()
        if fault == "worker":
            os.kill(stats["per_worker"][0]["pid"], signal.SIGKILL)
        elif fault == "agent":
            os.kill(stats["backend"]["agents"][0]["pid"], signal.SIGKILL)
        else:  # agent 0's node goes, and a new one joins (as an autoscaler would): the replacement needs room.
            node = next(n for n in cluster.worker_nodes if n.node_id == stats["backend"]["agents"][0]["node"])
            cluster.remove_node(node, allow_graceful=False)
            cluster.add_node(num_cpus=1, object_store_memory=NODE_STORE)  # (main thread only: it sets signals)
        try:
            for batch in it:
                seen += [int(i) for i in batch]
        except procpipe.ray.NodeLostError as exc:  # counted and shown, not hidden: the run goes on
            out.failures.append(str(exc).split(". ")[0])
            return
        done = time.perf_counter()
        out.done.values.append(done - killed)
        out.exactly_once.append(sorted(seen) == list(range(len(source))))
        if clock is not None:  # the epoch does not wait for the replacement (the other agent ran the lost
            deadline = time.monotonic() + 40  # one's batches): it is awaited here, to time it
            while clock.first("ready", 0, killed) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            clock.close()
            for what, series in (("lost", out.lost), ("ready", out.ready)):
                at = clock.first(what, 0, killed)
                if at is not None:
                    series.values.append(at - killed)
    finally:
        if clock is not None:
            clock.close()
        loader.close()
        if fault == "node":
            cluster.wait_for_nodes(timeout=120)


def recovery(sizes: Sizes, reps: int, cluster: Any, faults: list[str]) -> dict[str, Recovery]:
    out = {fault: Recovery() for fault in faults}
    print(
        "  recovery: Ray reports each agent killed and node removed here ('A worker died or was killed', "
        "'lost objects'...): expected",
        flush=True,
    )
    order = list(faults)
    for rep in range(reps):
        for fault in order if rep % 2 == 0 else order[::-1]:
            recover_once(fault, sizes, out[fault], cluster)
    print("  recovery: done", flush=True)
    return out


# --------------------------------------------------------------------------- report
ROWS: list[tuple[str, str, str, Callable[[float, float], float]]] = [
    # name, label, value format, ratio ray / local expressed so that > 1 means ray is worse
    ("transfer", "transfer, GB/s (higher is better)", "{:.2f}", lambda loc, ray: loc / ray),
    ("tiny64", "tiny64, us per batch", "{:.0f}", lambda loc, ray: ray / loc),
    ("tiny1", "tiny1, us per batch", "{:.0f}", lambda loc, ray: ray / loc),
    ("first", "time to first batch, s", "{:.2f}", lambda loc, ray: ray / loc),
]


MEANING = """\
What these figures mean: every Ray node here is a set of processes on this same machine ({cpus} CPUs),
sharing its cores with the training process, the raylets and each other; the network is loopback.
The ray column is the overhead of Ray's actor calls and object store per batch, not a cluster's
throughput: on a real cluster each node adds its own CPUs, and batches cross a real network.
'ray cost' is how many times worse ray is than local (time ratio; for GB/s, local / ray).
Recovery: 'lost' = the agent's death seen (the error), 'ready' = its replacement answered,
'epoch done' = the last batch of the epoch delivered (the epoch does not wait for the
replacement: the lost agent's batches are re-run at once by the other agent). A silent node (no error) is declared lost
after node_timeout (5 s here); neither fault here is silent: Ray reports a killed agent at once
and a removed node within a few seconds. A removed node's replacement needs a node with room: one
is added at once (about 4 s, in 'ready'); the replacement goes to a node other than the one lost."""


def report(results: dict[str, dict[str, Series]], rec: dict[str, Recovery], reps: int, sizes: Sizes) -> None:
    w = 36
    print()
    print(f"median [min-max] over {reps} repetitions, the engines alternating within each")
    print(f"{'measure':{w}} {'local workers=2':>24} {'ray 2 nodes x 1 worker':>24} {'ray cost':>9}")
    for name, label, fmt, ratio in ROWS:
        local, ray = results[name]["local"], results[name]["ray"]
        print(f"{label:{w}} {local.cell(fmt):>24} {ray.cell(fmt):>24} {ratio(local.median, ray.median):>8.1f}x")
    print()
    print(
        f"recovery: ~10 ms batches of 4, {sizes.recovery_batches} batches, the fault after {sizes.kill_after}; "
        "seconds after the fault"
    )
    print(f"{'engine (the fault)':{w}} {'-> lost':>20} {'-> ready':>20} {'-> epoch done':>20}  exactly once")
    for fault, r in rec.items():
        what = FAULTS[fault][1]
        once = "yes" if r.exactly_once and all(r.exactly_once) and not r.failures else "NO"
        print(
            f"{what:{w}} {r.lost.cell('{:.2f}'):>20} {r.ready.cell('{:.2f}'):>20} "
            f"{r.done.cell('{:.2f}'):>20}  {once} ({sum(r.exactly_once)}/{reps})"
        )
        for why in r.failures:
            print(f"  {'':{w - 2}} an epoch FAILED: {why}")
    print()
    print(MEANING.format(cpus=os.cpu_count()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each measure (default 5)")
    parser.add_argument("--quick", action="store_true", help="smaller epochs (a smoke run)")
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"recovery rows, comma-separated (default {','.join(FAULTS)}; 'node' adds ~20 s a rep)",
    )
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    if not faults or any(f not in FAULTS for f in faults):
        parser.error(f"--faults: choose from {', '.join(FAULTS)}, got {args.faults!r}")
    try:
        import ray
    except ImportError:
        print("this bench needs ray: pip install procpipe[ray]", file=sys.stderr)
        return 2
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # procpipe from this checkout, installed or not
    sizes = QUICK if args.quick else FULL
    started = time.perf_counter()
    print("starting a local cluster: head (0 CPUs) + 2 nodes of 1 CPU ...", flush=True)
    cluster = start_cluster(2)
    print(f"  cluster up in {time.perf_counter() - started:.0f} s", flush=True)
    results = {name: {engine: Series() for engine in ENGINES} for name, *_ in ROWS}
    try:
        steady_state(sizes, args.reps, results)
        first_batch(args.reps, results)
        rec = recovery(sizes, args.reps, cluster, faults)
    finally:
        ray.shutdown()
        cluster.shutdown()
    report(results, rec, args.reps, sizes)
    print(f"\nwhole run: {time.perf_counter() - started:.0f} s")
    return 0 if all(all(r.exactly_once) for r in rec.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
