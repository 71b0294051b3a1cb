"""Scenarios of procpipe.jax, each run in its own interpreter by tests/test_jax.py.

JAX reads ``XLA_FLAGS`` (here: 8 CPU devices, or 4 per process with two) once, when it
starts, so these run apart from pytest's process. Each prints ``CHECK name json`` lines
that the tests assert; ``CHECK done true`` last.

    python tests/jax_check.py single                  # one process, 8 devices
    python tests/jax_check.py save DIR | restore DIR  # an Orbax save mid-epoch, a restore in a fresh process
    python tests/jax_check.py multi ID PORT DIR       # one of two processes joined on 127.0.0.1:PORT
    python tests/jax_check.py restore1 DIR            # one process resumes the two processes' save
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
from typing import Any, NamedTuple

SCENARIO = sys.argv[1]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + ("4" if SCENARIO == "multi" else "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import procpipe  # noqa: E402
import procpipe.jax  # noqa: E402

N = 96


class Pair(NamedTuple):
    x: object
    y: object


def check(name: str, value: object) -> None:
    print(f"CHECK {name} {json.dumps(value)}", flush=True)


def sample(i: int) -> dict:
    return {"x": np.arange(3, dtype=np.float32) + 10 * i, "y": np.int64(i), "name": f"s{i}"}


def ids(batch: dict) -> list[int]:
    return np.asarray(batch["y"]).tolist()


def loader(**kw: object) -> procpipe.Loader:
    kw = {"batch_size": 16, "workers": 2, "shuffle": True, "seed": 5, "drop_last": True, **kw}
    return procpipe.Loader(list(range(N)), sample, **kw)


def raises(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# --------------------------------------------------------------------------- one process
def single() -> None:
    with loader(workers=0) as ref_loader:
        reference = [{"x": b["x"].tolist(), "y": b["y"].tolist(), "name": b["name"]} for b in ref_loader]
    with loader() as lo:
        batches = procpipe.jax.iterator(lo, prefetch=3)
        check("len", len(batches))
        got = list(batches)
        x = got[0]["x"]
        check("types", [type(x).__name__ == "ArrayImpl" or isinstance(x, jax.Array), type(got[0]["name"]).__name__])
        check("content_equal", [
            {"x": np.asarray(b["x"]).tolist(), "y": np.asarray(b["y"]).tolist(), "name": b["name"]} for b in got
        ] == reference)
        check("default_sharding", [
            x.sharding == procpipe.jax.default_sharding(), str(x.sharding.spec), len(x.addressable_shards),
            sorted({s.data.shape for s in x.addressable_shards})[0],
        ])
        check("epoch_after_pass", lo.epoch)
        second = [i for b in batches for i in ids(b)]  # the second pass: epoch 1, every sample once
        check("second_pass_once", sorted(second) == list(range(N)) and second != [i for b in got for i in ids(b)])
        check("epoch_after_second_pass", lo.epoch)

        # a 2-D mesh: the batch over "data" (4), replicated over "model" (2)
        mesh = Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "model"))
        asked = NamedSharding(mesh, PartitionSpec("data"))
        b = next(iter(procpipe.jax.iterator(lo, asked, prefetch=0)))
        x = b["x"]
        check("custom_sharding", [
            x.sharding == asked, sorted({s.data.shape for s in x.addressable_shards})[0],
            len({str(s.index) for s in x.addressable_shards}), b["y"].sharding == asked,
        ])

    # every sample exactly once over an epoch, with and without the thread, unshuffled and shuffled
    once = {}
    for prefetch in (0, 1, 4):
        with loader(drop_last=False, batch_size=8, shuffle=prefetch != 0) as lo:
            seen = [i for b in procpipe.jax.iterator(lo, prefetch=prefetch) for i in ids(b)]
            once[prefetch] = sorted(seen) == list(range(N)) and len(seen) == N
    check("every_sample_once", once)

    # tuples, namedtuples, bare arrays; strings left alone
    def as_tuple(i: int) -> tuple:
        return (np.full(2, i, np.int32), f"t{i}", [np.int16(i)])

    with procpipe.Loader(list(range(32)), as_tuple, batch_size=8, workers=0) as lo:
        b = next(iter(procpipe.jax.iterator(lo)))
        check("tuple_batch", [type(b).__name__, isinstance(b[0], jax.Array), b[1][:2],
                              np.asarray(b[0])[:, 0].tolist()])
    with procpipe.Loader(list(range(32)), lambda i: Pair(np.float32(i), np.full(4, i, np.uint8)),
                         batch_size=8, workers=0) as lo:
        b = next(iter(procpipe.jax.iterator(lo)))
        check("namedtuple_batch", [type(b).__name__, isinstance(b.x, jax.Array), b.y.shape, str(b.y.dtype)])
    with procpipe.Loader(list(range(32)), lambda i: np.full(5, i, np.float32), batch_size=8, workers=0) as lo:
        b = next(iter(procpipe.jax.iterator(lo)))
        check("array_batch", [isinstance(b, jax.Array), list(b.shape)])

    # state_dict() while the thread holds batches: it counts what the loop took
    with loader(batch_size=8, drop_last=False) as lo:
        it = iter(procpipe.jax.iterator(lo, prefetch=4))
        taken = [i for _ in range(3) for i in ids(next(it))]
        deadline = __import__("time").monotonic() + 60
        while lo.stats()["batches_consumed"] < 3 + 4 and __import__("time").monotonic() < deadline:
            __import__("time").sleep(0.01)
        held = lo.stats()["batches_consumed"] - 3
        state = lo.state_dict()
        check("state_while_held", [held, state["done_below"], state["epoch"]])
        rest_uninterrupted = [i for b in it for i in ids(b)]
    with loader(batch_size=8, drop_last=False) as lo:
        lo.load_state_dict(json.loads(json.dumps(state)))
        rest = [i for b in procpipe.jax.iterator(lo, prefetch=2) for i in ids(b)]
        check("resume_exact", [rest == rest_uninterrupted, sorted(taken + rest) == list(range(N))])

    # clear errors
    with loader(workers=0) as lo:
        check("err_prefetch", raises(lambda: procpipe.jax.iterator(lo, prefetch=-1)))
        check("err_sharding", raises(lambda: procpipe.jax.iterator(lo, sharding="data")))
    with procpipe.Loader(list(range(32)), lambda i: {"a": np.zeros(8), "b": np.zeros((4, 3))},
                         batch_size=None, workers=0) as lo:
        check("err_rows", raises(lambda: next(iter(procpipe.jax.iterator(lo, prefetch=0)))))
    with loader(batch_size=12, workers=0) as lo:
        check("err_indivisible", raises(lambda: next(iter(procpipe.jax.iterator(lo)))))
    check("shard_single", procpipe.jax.shard())
    plain = procpipe.jax.iterator([{"a": np.full((8, 2), k, np.int32)} for k in range(3)])
    check("plain_iterable", [len(plain), [int(b["a"][0, 0]) for b in plain], [int(b["a"][7, 1]) for b in plain]])
    if importlib.util.find_spec("torch") is not None:
        with loader(workers=0, device="cpu") as lo:
            check("err_device", raises(lambda: procpipe.jax.iterator(lo)))


# --------------------------------------------------------------------------- Orbax, one process
def manager(directory: str) -> Any:
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(directory)


def save(directory: str) -> None:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    with loader(batch_size=8) as lo:
        taken, uninterrupted = [], []
        mngr = manager(directory)
        for k, b in enumerate(procpipe.jax.iterator(lo, prefetch=3)):
            (uninterrupted if k >= 3 else taken).extend(ids(b))
            if k == 2:  # three batches taken, three more made ahead
                mngr.save(3, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": jnp.arange(4.0)}),
                                                     loader=procpipe.jax.LoaderSave(lo)))
                mngr.wait_until_finished()
        mngr.close()
        check("taken", taken)
        check("uninterrupted", uninterrupted)
        check("next_epoch", [i for b in procpipe.jax.iterator(lo) for i in ids(b)])


def restore(directory: str) -> None:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    with loader(batch_size=8, workers=1) as lo:
        mngr = manager(directory)
        restored = mngr.restore(3, args=ocp.args.Composite(params=ocp.args.StandardRestore({"w": jnp.zeros(4)}),
                                                           loader=procpipe.jax.LoaderRestore(lo)))
        mngr.close()
        check("params", np.asarray(restored["params"]["w"]).tolist())
        batches = procpipe.jax.iterator(lo, prefetch=2)
        check("rest", [i for b in batches for i in ids(b)])
        check("next_epoch", [i for b in batches for i in ids(b)])


# --------------------------------------------------------------------------- two processes
def multi(process_id: int, port: int, directory: str) -> None:
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60, heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
    check("processes", [jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count()])
    check("shard", procpipe.jax.shard())
    with loader(batch_size=8, shard=procpipe.jax.shard()) as lo:
        batches = procpipe.jax.iterator(lo, prefetch=2)
        global_batches = []
        for b in batches:
            check_x = np.asarray(multihost_utils.process_allgather(b["x"], tiled=True))
            y = np.asarray(multihost_utils.process_allgather(b["y"], tiled=True)).tolist()
            global_batches.append(y)
            assert b["y"].shape == (16,), b["y"].shape
            assert np.array_equal(check_x, np.stack([sample(i)["x"] for i in y]))
        check("global_batches", global_batches)
    # what one process makes: the two ranks' loaders side by side, and one loader of 16
    with loader(batch_size=8, shard=(0, 2), workers=0) as a, loader(batch_size=8, shard=(1, 2), workers=0) as c:
        check("by_one_process", [ids(x) + ids(z) for x, z in zip(a, c, strict=True)])
    with loader(batch_size=16, workers=0) as whole:
        check("unsharded_16", [sorted(ids(b)) for b in whole])

    # an Orbax save mid-epoch by both processes (restored by one: combine_states)
    with loader(batch_size=8, shard=procpipe.jax.shard()) as lo:
        mngr = ocp.CheckpointManager(directory)
        taken = []
        for k, b in enumerate(procpipe.jax.iterator(lo, prefetch=3)):
            taken += np.asarray(multihost_utils.process_allgather(b["y"], tiled=True)).tolist()
            if k == 1:
                replicated = NamedSharding(Mesh(np.asarray(jax.devices()), ("data",)), PartitionSpec())
                w = jax.make_array_from_process_local_data(replicated, np.arange(4.0, dtype=np.float32))
                mngr.save(2, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": w}),
                                                     loader=procpipe.jax.LoaderSave(lo)))
                mngr.wait_until_finished()
                break
        mngr.close()
        check("taken_before_save", taken)

    # errors: a loader without this process's shard; batches of different sizes
    with loader(batch_size=8, workers=0) as lo:
        check("err_shard", raises(lambda: procpipe.jax.iterator(lo)))
    with loader(batch_size=8 if process_id == 0 else 4, shard=procpipe.jax.shard(), workers=0) as lo:
        check("err_sizes", raises(lambda: next(iter(procpipe.jax.iterator(lo)))))
    # every loader is closed: none of their prefetching threads may be left inside JAX's code (at
    # exit such a daemon thread aborts the process: "terminate called ... exception not rethrown")
    check("stage_threads", [t.name for t in threading.enumerate() if t.name == "procpipe-device-stage"])
    jax.distributed.shutdown()


def restore1(directory: str) -> None:
    import orbax.checkpoint as ocp

    with loader(batch_size=8, workers=0) as lo:
        mngr = ocp.CheckpointManager(directory)
        state = mngr.restore(2, args=ocp.args.Composite(loader=procpipe.jax.LoaderRestore(lo)))["loader"]
        mngr.close()
        check("combined", "combined" in state)
        check("rest", [i for b in procpipe.jax.iterator(lo, prefetch=1) for i in ids(b)])


if __name__ == "__main__":
    if SCENARIO == "single":
        single()
    elif SCENARIO == "save":
        save(sys.argv[2])
    elif SCENARIO == "restore":
        restore(sys.argv[2])
    elif SCENARIO == "multi":
        multi(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif SCENARIO == "restore1":
        restore1(sys.argv[2])
    else:
        raise SystemExit(f"unknown scenario {SCENARIO!r}")
    check("done", True)
