"""Worker memory over one epoch: dataset metadata as a plain list of dicts vs procpipe.Records.

A dataset holds N records like ``{"path": "/data/images/0000042.jpg", "label": 42}``; its
``__getitem__`` reads one and returns ``(len(path), label)``. One epoch (shuffled, as in
training) runs through ``procpipe.Loader(workers=2)``, and the workers' private memory
(USS, psutil ``memory_full_info().uss``: pages mapped by that process alone) is read from
the consumer loop when the first batch arrives and again at the end of the epoch, before
``close()``.

With ``fork``, the workers inherit the list: reading a record writes the reference counts
of the dict, its strings and ints (and a full collection of the cyclic GC would touch
every dict), so the pages they live on are copied into each worker as the epoch goes
(pytorch#13246). With
``forkserver``, each worker unpickles its own full copy of the list at start. With
Records, the workers map the parent's read-only file: nothing is copied.

Each scenario runs in a fresh interpreter (so memory freed by one cannot blur the next),
started by this script; the table comes out at the end.

Run: python bench/records_memory.py [--records N] [--batch-size B] [--no-shuffle]
                                   [--start-methods fork,forkserver] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import psutil

import procpipe

MiB = 2**20


class Metadata:
    """A dataset over records (a list of dicts or a procpipe.Records)."""

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        record = self.records[i]
        return len(record["path"]), record["label"]


def make_records(n):
    return [{"path": f"/data/images/{i:07d}.jpg", "label": i % 1000} for i in range(n)]


def uss(pids):
    return [psutil.Process(pid).memory_full_info().uss for pid in pids]


def scenario(source_kind, start_method, n, batch_size, shuffle):
    """One epoch in this process; returns the measurements as a dict."""
    started = time.perf_counter()
    records = make_records(n)
    nbytes = None
    if source_kind == "Records":
        records = procpipe.Records(records)
        nbytes = records.nbytes
        gc.collect()  # the list is gone: only the packed file remains
    build_s = time.perf_counter() - started
    parent_rss = psutil.Process().memory_info().rss
    expected = (sum(len(f"/data/images/{i:07d}.jpg") for i in range(n)), sum(i % 1000 for i in range(n)))
    started = time.perf_counter()
    loader = procpipe.Loader(
        Metadata(records), batch_size=batch_size, workers=2, start_method=start_method, shuffle=shuffle
    )
    with loader:
        it = iter(loader)
        lengths, labels = next(it)
        first_s = time.perf_counter() - started
        start = uss(loader.worker_pids)
        total = [int(lengths.sum()), int(labels.sum())]
        for lengths, labels in it:
            total[0] += int(lengths.sum())
            total[1] += int(labels.sum())
        end = uss(loader.worker_pids)  # end of the epoch, workers still alive
    epoch_s = time.perf_counter() - started
    if tuple(total) != expected:
        raise AssertionError(f"wrong values read: {total} != {expected}")
    if source_kind == "Records":
        records.close()
    return {
        "source": source_kind,
        "start_method": start_method,
        "records": n,
        "build_s": build_s,
        "first_batch_s": first_s,
        "epoch_s": epoch_s,
        "uss_start": start,
        "uss_end": end,
        "parent_rss": parent_rss,
        "records_nbytes": nbytes,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000, help="number of records (default 1,000,000)")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--start-methods", default="fork,forkserver")
    parser.add_argument(
        "--no-shuffle", action="store_true", help="read the records in order (default: shuffled, as in training)"
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--scenario", help=argparse.SUPPRESS)  # internal: SOURCE:START_METHOD, in a child
    args = parser.parse_args()
    if args.scenario:
        source, method = args.scenario.split(":")
        print(json.dumps(scenario(source, method, args.records, args.batch_size, not args.no_shuffle)))
        return

    results = []
    for method in args.start_methods.split(","):
        for source in ("list", "Records"):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--scenario",
                f"{source}:{method}",
                "--records",
                str(args.records),
                "--batch-size",
                str(args.batch_size),
            ]
            cmd += ["--no-shuffle"] if args.no_shuffle else []
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                sys.exit(f"{source}:{method} failed:\n{out.stdout}\n{out.stderr}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"done: {source:7} {method}", file=sys.stderr, flush=True)

    print(
        f"\n{args.records:,} records, 2 workers, batch {args.batch_size}, one epoch; "
        f"{'in order' if args.no_shuffle else 'shuffled'}; USS of each worker in MiB (worker 0 / worker 1)\n"
    )
    print(
        "| start method | metadata | parent RSS (MiB) | worker USS at first batch | at end of epoch "
        "| growth (sum of both) | Loader() to end of epoch (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        start = " / ".join(f"{u / MiB:.1f}" for u in r["uss_start"])
        end = " / ".join(f"{u / MiB:.1f}" for u in r["uss_end"])
        growth = (sum(r["uss_end"]) - sum(r["uss_start"])) / MiB
        source = "list of dicts" if r["source"] == "list" else f"Records ({r['records_nbytes'] / MiB:.1f} MiB file)"
        print(
            f"| {r['start_method']} | {source} | {r['parent_rss'] / MiB:.0f} | {start} | {end} "
            f"| {growth:+.1f} | {r['epoch_s']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "cpu_count": os.cpu_count(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
