"""Preemption: checkpoint the loader with the model, get SIGKILLed mid-epoch, resume exactly there.

A training job on a preemptible machine saves a checkpoint every few steps: the model's
state and ``loader.state_dict()`` (a small JSON-friendly dict), side by side. When the
job is killed, a new process builds the same ``Loader``, calls ``load_state_dict()``, and
goes on: every record the checkpointed model had seen is left out, every other record
comes exactly once, and (with ordered delivery) the batches are the very ones the
uninterrupted run would have had. Records read after the last checkpoint are read again,
as they must be: the model that saw them was lost with the process.

Here the data is a streaming source: six binary shard files of fixed-size records
(an id and a 24-byte payload), read three at a time and interleaved (``procpipe.Shards``).
The "model" is the list of record ids it has trained on. The parent runs the job as a
child process, SIGKILLs it (the job kills itself after 1,500 records, so the point is
reproducible), checks that no worker or shared-memory file outlived it, runs it again to
the end, and compares with an uninterrupted run.

Run: python examples/resume_after_preemption.py
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil

import procpipe

SHARDS, PER_SHARD, PAYLOAD = 6, 500, 24
RECORD = 8 + PAYLOAD
CHECKPOINT_EVERY = 10  # steps


def write_shards(directory):
    """Six files of PER_SHARD records each: an int64 id, then PAYLOAD bytes."""
    paths = []
    for s in range(SHARDS):
        path = os.path.join(directory, f"part-{s:02d}.bin")
        ids = np.arange(s * PER_SHARD, (s + 1) * PER_SHARD, dtype=np.int64)
        payload = np.random.default_rng(s).integers(0, 256, (PER_SHARD, PAYLOAD), dtype=np.uint8)
        with open(path, "wb") as f:
            for i, p in zip(ids, payload):
                f.write(i.tobytes() + p.tobytes())
        paths.append(path)
    return paths


def read_records(path):
    """open_fn: the records of one shard file, in order (runs in a worker)."""
    with open(path, "rb") as f:
        while chunk := f.read(RECORD):
            yield chunk


def decode(record):
    """fn: bytes -> a dict of arrays (runs in the workers)."""
    return {"id": int(np.frombuffer(record[:8], np.int64)[0]),
            "x": np.frombuffer(record[8:], np.uint8).astype(np.float32) / 255}


def save(path, state):
    """Write a checkpoint atomically: a kill in the middle leaves the previous one."""
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)


def train(directory, checkpoint, die_after=None, announce=False):
    """The training job. Returns the ids the model trained on, in order.

    ``announce``: print the worker pids first (so the parent can check they die with the job).
    """
    paths = sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".bin"))
    source = procpipe.Shards(paths, read_records, cycle_length=3)
    with procpipe.Loader(source, decode, batch_size=32, workers=2, shuffle=True, seed=7) as loader:
        if announce:
            print("WORKERS " + json.dumps(loader.worker_pids), flush=True)
        seen = []
        if checkpoint and os.path.exists(checkpoint):
            with open(checkpoint) as f:
                state = json.load(f)
            loader.load_state_dict(state["loader"])
            seen = state["model"]
            print(f"resumed from a checkpoint after {len(seen)} records", flush=True)
        for step, batch in enumerate(loader, 1):
            seen.extend(batch["id"].tolist())  # the training step
            if checkpoint and step % CHECKPOINT_EVERY == 0:
                save(checkpoint, {"model": seen, "loader": loader.state_dict()})
            if die_after is not None and len(seen) >= die_after:
                os.kill(os.getpid(), signal.SIGKILL)  # preempted: no cleanup code of ours runs
    return seen


def run_job(directory, checkpoint, die_after=None):
    """Run the job in a new process: (its pid, exit code, stdout)."""
    args = [sys.executable, os.path.abspath(__file__), "--job", directory, checkpoint]
    if die_after is not None:
        args.append(str(die_after))
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    return proc.pid, proc.returncode, out


def tagged(out, tag):
    return json.loads(next(line for line in out.splitlines() if line.startswith(tag + " "))[len(tag) + 1:])


def leftovers(pid, workers, deadline_s=10.0):
    """The dead job's workers and /dev/shm files still there, once given a few seconds to go."""
    end = time.monotonic() + deadline_s
    while True:
        files = [f for f in os.listdir("/dev/shm") if f.startswith(f"procpipe-{pid}-")]
        alive = [w for w in workers if psutil.pid_exists(w) and psutil.Process(w).status() != psutil.STATUS_ZOMBIE]
        if not files and not alive or time.monotonic() > end:
            return files + alive
        time.sleep(0.1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--job"]:
        directory, checkpoint = sys.argv[2], sys.argv[3]
        die_after = int(sys.argv[4]) if len(sys.argv) > 4 else None
        print("RESULT " + json.dumps(train(directory, checkpoint, die_after, announce=True)))
        sys.exit(0)

    with tempfile.TemporaryDirectory() as tmp:
        write_shards(tmp)
        checkpoint = os.path.join(tmp, "checkpoint.json")
        uninterrupted = train(tmp, None)

        pid, code, out = run_job(tmp, checkpoint, die_after=1500)
        print(f"job 1: killed by {signal.Signals(-code).name} after 1500 records")
        with open(checkpoint) as f:
            saved = json.load(f)
        print(f"last checkpoint: {len(saved['model'])} records, loader state "
              f"{len(json.dumps(saved['loader']))} bytes of JSON")
        print(f"left behind by the killed job (workers, /dev/shm files): {leftovers(pid, tagged(out, 'WORKERS'))}")

        pid, code, out = run_job(tmp, checkpoint)
        assert code == 0, out
        print("job 2:", out.splitlines()[1])
        resumed = tagged(out, "RESULT")
        total = SHARDS * PER_SHARD
        print(f"records trained on: {len(resumed)} of {total}, every record exactly once: "
              f"{sorted(resumed) == list(range(total))}")
        print(f"same batches, in the same order, as an uninterrupted run: {resumed == uninterrupted}")
