"""Stragglers: how long the training loop waits when 1 task in 50 stalls for 300 ms.

Workload: batches of 8 samples, each sample ``time.sleep(0.5 ms)`` (about 4 ms a batch);
the first sample of every 50th batch (batch 25, 75, ...) stalls 300 ms, *on the first
attempt only*, like a slow remote read that succeeds when retried. The consumer spends
10 ms per batch (``time.sleep``, like a training step on an accelerator). Two workers,
the same number of batches in flight for every engine (procpipe keeps
``prefetch + 2 * workers`` = 6; the DataLoader gets ``prefetch_factor=3``).

Rows, all in one run: procpipe ordered, procpipe sloppy (``ordered=False``), procpipe
ordered with ``speculate=3.0``, PyTorch's DataLoader with ``in_order=True`` and ``False``.
The figure is the consumer's wait: seconds spent inside ``next()`` over the epoch,
after the first batch (start-up is reported apart). With 2 workers the pipeline
produces a batch every ~2 ms while the consumer needs 10 ms, so the ideal wait is ~0;
whatever is left is head-of-line blocking behind the stalled batch.

    python bench/straggler_table.py            # 400 batches (8 stalls), 3 alternating repetitions
    python bench/straggler_table.py --quick    # 150 batches (3 stalls), 1 repetition

``run(quick) -> list[dict]`` returns the rows (for ``bench/compare.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from procpipe import Loader

BATCH = 8
SAMPLE_S = 0.0005
STALL_S = 0.3
STALL_EVERY = 50  # batches
CONSUMER_S = 0.010
WORKERS = 2
PREFETCH = 2
IN_FLIGHT = PREFETCH + 2 * WORKERS  # procpipe's outstanding batches; matched for the DataLoader


class StallOnce:
    """``source[i]``: 0.5 ms per sample; the first sample of every 50th batch stalls 300 ms once.

    "Once" is decided with an ``O_EXCL`` marker file in ``marks``: a re-run of the batch
    (after speculation) finds it and does not stall, as a retried remote read would not.
    """

    def __init__(self, n: int, marks: str) -> None:
        self.n, self.marks = n, marks

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        time.sleep(SAMPLE_S)
        if i % (STALL_EVERY * BATCH) == (STALL_EVERY // 2) * BATCH:
            try:
                os.close(os.open(os.path.join(self.marks, str(i)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                time.sleep(STALL_S)
            except FileExistsError:
                pass
        return np.full(16, i, np.float32), i


def _consume(batches: Any) -> dict[str, float]:
    """Iterate like a training loop; the wait inside ``next()``, after the first batch."""
    it = iter(batches)
    started = time.perf_counter()
    next(it)
    first = time.perf_counter() - started
    wait, count = 0.0, 1
    while True:
        t = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        wait += time.perf_counter() - t
        count += 1
        time.sleep(CONSUMER_S)  # the training step
    return {"first_batch_s": first, "wait_s": wait, "wall_s": time.perf_counter() - started, "batches": count}


def _procpipe(n: int, marks: str, **kwargs: Any) -> dict[str, float]:
    with Loader(StallOnce(n, marks), batch_size=BATCH, workers=WORKERS, prefetch=PREFETCH, **kwargs) as loader:
        out = _consume(loader)
        out["speculative_tasks"] = loader.stats()["speculative_tasks"]
        return out


def _dataloader(n: int, marks: str, in_order: bool) -> dict[str, float]:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(
        StallOnce(n, marks),
        batch_size=BATCH,
        num_workers=WORKERS,
        prefetch_factor=IN_FLIGHT // WORKERS,
        in_order=in_order,
        multiprocessing_context="fork",
    )
    return _consume(loader)


ENGINES = {
    "procpipe ordered": _procpipe,
    "procpipe sloppy": lambda n, m: _procpipe(n, m, ordered=False),
    "procpipe ordered + speculate=3": lambda n, m: _procpipe(n, m, speculate=3.0),
    "DataLoader in_order=True": lambda n, m: _dataloader(n, m, True),
    "DataLoader in_order=False": lambda n, m: _dataloader(n, m, False),
}


def run(quick: bool) -> list[dict]:
    """One row per engine: the medians over the repetitions (engines alternate within each)."""
    batches, reps = (150, 1) if quick else (400, 3)
    n = batches * BATCH
    stalls = sum(1 for b in range(batches) if b % STALL_EVERY == STALL_EVERY // 2)
    names = list(ENGINES)
    try:
        import torch  # noqa: F401
    except ImportError:
        names = [name for name in names if not name.startswith("DataLoader")]
    results: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # drift hits every engine alike
        for name in order:
            marks = tempfile.mkdtemp(prefix="procpipe-straggler-")
            try:
                results[name].append(ENGINES[name](n, marks))
            finally:
                shutil.rmtree(marks, ignore_errors=True)
    rows = []
    for name in names:
        runs = results[name]
        wait = statistics.median(r["wait_s"] for r in runs)
        rows.append(
            {
                "engine": name,
                "batches": batches,
                "stalls": stalls,
                "repetitions": reps,
                "wait_s": wait,
                "wait_per_stall_ms": 1000 * wait / stalls,
                "wall_s": statistics.median(r["wall_s"] for r in runs),
                "consumer_s": (batches - 1) * CONSUMER_S,
                "first_batch_s": statistics.median(r["first_batch_s"] for r in runs),
                "speculative_tasks": statistics.median(r.get("speculative_tasks", 0) for r in runs),
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'engine':<32} {'wait s':>8} {'per stall ms':>13} {'epoch s':>8} {'training s':>11} "
        f"{'1st batch s':>12} {'spec. tasks':>12}"
    )
    lines = [head, "-" * len(head)]
    lines.extend(
        f"{r['engine']:<32} {r['wait_s']:>8.3f} {r['wait_per_stall_ms']:>13.0f} {r['wall_s']:>8.2f} "
        f"{r['consumer_s']:>11.2f} {r['first_batch_s']:>12.3f} {r['speculative_tasks']:>12.0f}"
        for r in rows
    )
    r = rows[0]
    lines.append(
        f"({r['batches']} batches of {BATCH}, {r['stalls']} stalls of {STALL_S * 1000:.0f} ms, "
        f"{CONSUMER_S * 1000:.0f} ms per training step, {WORKERS} workers, {IN_FLIGHT} batches in flight, "
        f"median of {r['repetitions']}; wait = time inside next() after the first batch)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="150 batches, one repetition")
    print(format_table(run(parser.parse_args().quick)))


if __name__ == "__main__":
    main()
