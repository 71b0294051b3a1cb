"""A container's small ``/dev/shm``: which loaders run in it, at which batch size, and how fast.

Docker and Kubernetes give a container a 64 MB ``/dev/shm`` unless told otherwise. This runs each
loader in a private mount namespace (``unshare -m`` as root, ``unshare -rm`` otherwise) whose
``/dev/shm`` is a tmpfs of ``--shm-size``, on the container report's workload (224x224x3 uint8
images, a copy of a preloaded array each, ``--workers`` workers), at each batch size, and prints
whether it ran (and its rate over the epochs after the first) or how it died:

- ``torch``: ``torch.utils.data.DataLoader`` (a new ``/dev/shm`` file per batch);
- ``procpipe``: ``procpipe.Loader`` with its defaults (anonymous shared memory);
- ``facade``: ``procpipe.torch.DataLoader`` with its defaults.

The loaders alternate within each repetition (a rotating order), each in a fresh interpreter,
so that a noisy machine hits them alike; a rate is the median of the repetitions, and the
ratios are to torch's where torch ran.

    python bench/containers.py                           # 64 MB, batches 64 and 256, 3 repetitions
    python bench/containers.py --shm-size 8m --batches 64 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOADERS = ("torch", "procpipe", "facade")

RUN = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    kind, batch_size, workers, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    N = batch_size * 40
    BASE = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)

    def image(i):
        return BASE.copy()

    if kind == "procpipe":
        import procpipe
        loader = procpipe.Loader(list(range(N)), image, batch_size=batch_size, workers=workers)
    else:
        import torch

        class Images(torch.utils.data.Dataset):
            def __len__(self):
                return N
            def __getitem__(self, i):
                return torch.from_numpy(image(i))

        if kind == "torch":
            loader = torch.utils.data.DataLoader(Images(), batch_size=batch_size, num_workers=workers)
        else:
            import procpipe.torch
            loader = procpipe.torch.DataLoader(Images(), batch_size=batch_size, num_workers=workers)
    try:
        for _ in loader:  # the first epoch: start-up, the ring sized
            pass
        started = time.perf_counter()
        for _ in range(epochs):
            for _ in loader:
                pass
        seconds = time.perf_counter() - started
        print(json.dumps({"ok": True, "gbps": epochs * N * BASE.nbytes / seconds / 1e9}), flush=True)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}),
              flush=True)
""")


def run(kind: str, batch_size: int, workers: int, epochs: int, shm_size: str) -> dict:
    """One loader's epochs in a fresh interpreter, in a namespace whose /dev/shm is ``shm_size``."""
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    mount = 'mount -t tmpfs -o size="$0" tmpfs /dev/shm && exec "$@"'
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(
        [
            *unshare,
            "sh",
            "-c",
            mount,
            shm_size,
            sys.executable,
            "-c",
            RUN,
            kind,
            str(batch_size),
            str(workers),
            str(epochs),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    return {"ok": False, "error": f"died (exit {done.returncode}): {last[:160]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shm-size", default="64m", help="the tmpfs size of /dev/shm (default 64m)")
    parser.add_argument("--batches", default="64,256", help="batch sizes, comma-separated")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs of 40 batches, after a first one")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--loaders", default=",".join(LOADERS))
    args = parser.parse_args()
    if shutil.which("unshare") is None:
        sys.exit("needs unshare (util-linux) to mount a small /dev/shm in a private namespace")
    loaders = args.loaders.split(",")
    print(f"/dev/shm of {args.shm_size}, {args.workers} workers, 224x224x3 uint8 images")
    print(f"{'batch':>6} {'loader':>9} {'GB/s (median)':>14} {'vs torch':>9}  outcome")
    for batch_size in (int(b) for b in args.batches.split(",")):
        results: dict[str, list[dict]] = {k: [] for k in loaders}
        for rep in range(args.reps):
            order = loaders[rep % len(loaders) :] + loaders[: rep % len(loaders)]
            for kind in order:
                results[kind].append(run(kind, batch_size, args.workers, args.epochs, args.shm_size))
        medians = {
            k: statistics.median(r["gbps"] for r in rs) if rs and all(r["ok"] for r in rs) else None
            for k, rs in results.items()
        }
        for kind in loaders:
            failed = [r["error"] for r in results[kind] if not r["ok"]]
            rate = medians[kind]
            base = medians.get("torch")
            ratio = f"{rate / base:.2f}x" if rate and base else "-"
            shown = f"{rate:.2f}" if rate is not None else "-"
            outcome = f"dies ({len(failed)} of {args.reps}): {failed[0]}" if failed else "runs"
            print(f"{batch_size:>6} {kind:>9} {shown:>14} {ratio:>9}  {outcome}")


if __name__ == "__main__":
    main()
