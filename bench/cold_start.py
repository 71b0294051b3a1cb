"""Cold start: time to the first batch in a fresh script that imports torch.

Each measurement is a new Python process running a script the way a user writes one (no
``if __name__ == "__main__":`` guard): it imports torch, numpy and the loader, builds a
map-style dataset, and times from creating the loader to receiving the first batch (the
"first batch" column); "process" is the script's whole run (imports included, until the
loader is closed). The loaders, alternated in a rotating order within each repetition
so that a noisy machine hits them alike:

- ``torch``: ``torch.utils.data.DataLoader`` (its default start method, fork);
- ``procpipe``: ``procpipe.Loader`` with its defaults (``start_method="auto"``);
- ``facade``: ``procpipe.torch.DataLoader`` with its defaults;
- ``procpipe-forkserver``: ``procpipe.Loader(start_method="forkserver")``, the start a
  process with running threads gets.

Prints every run, then per loader the median, min and max, and each median's ratio to
torch's.

    python bench/cold_start.py               # 5 repetitions, about a minute on 2 cores
    python bench/cold_start.py --reps 9 --workers 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import textwrap

from script_run import run_script

SCRIPT = textwrap.dedent('''
    import json, sys, time
    T0 = time.perf_counter()
    import numpy as np
    import torch
    kind, workers = sys.argv[1], int(sys.argv[2])

    class Images:
        """A small image-like map-style dataset: 256 samples of 3x64x64 float32."""
        def __len__(self):
            return 256
        def __getitem__(self, i):
            rng = np.random.default_rng(i)
            return rng.standard_normal((3, 64, 64), dtype=np.float32), np.int64(i % 10)

    if kind == "torch":
        from torch.utils.data import DataLoader
        make = lambda: DataLoader(Images(), batch_size=32, num_workers=workers)
    elif kind == "facade":
        from procpipe.torch import DataLoader
        make = lambda: DataLoader(Images(), batch_size=32, num_workers=workers)
    else:
        import procpipe
        method = "forkserver" if kind == "procpipe-forkserver" else "auto"
        make = lambda: procpipe.Loader(Images(), batch_size=32, workers=workers, start_method=method)
    start = time.perf_counter()
    loader = make()
    it = iter(loader)
    first = next(it)
    t_first = time.perf_counter() - start
    method = getattr(loader, "start_method", "-")  # procpipe's, resolved ("auto": what it picked here)
    del it
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    print(json.dumps({"first": t_first, "process": time.perf_counter() - T0, "start_method": method}))
''')

KINDS = ("torch", "procpipe", "facade", "procpipe-forkserver")


def run_once(path: str, kind: str, workers: int) -> dict[str, float]:
    return run_script(sys.executable, path, [kind, str(workers)], timeout=300, what=kind)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    opts = p.parse_args(argv)
    kinds = opts.kinds.split(",")
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.py")
        with open(path, "w") as f:
            f.write(SCRIPT)
        for rep in range(opts.reps):
            order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
            for kind in order:
                r = run_once(path, kind, opts.workers)
                results[kind].append(r)
                print(
                    f"rep {rep}  {kind:20s} first batch {r['first']:.3f} s   process {r['process']:.3f} s"
                    f"   (start method: {r['start_method']})",
                    flush=True,
                )
    base = statistics.median(r["first"] for r in results["torch"]) if "torch" in results else None
    print(f"\nworkers={opts.workers}, {opts.reps} fresh processes per loader; seconds")
    print(f"{'loader':20s} {'first: median':>14s} {'min':>7s} {'max':>7s} {'x torch':>8s} {'process median':>15s}")
    for kind in kinds:
        firsts = [r["first"] for r in results[kind]]
        median = statistics.median(firsts)
        ratio = f"{median / base:.2f}" if base else "-"
        print(
            f"{kind:20s} {median:14.3f} {min(firsts):7.3f} {max(firsts):7.3f} {ratio:>8s} "
            f"{statistics.median(r['process'] for r in results[kind]):15.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
