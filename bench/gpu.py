"""procpipe's CUDA consumer beside torch's DataLoader (``pin_memory=True``, same workers), in one run.

    python bench/gpu.py                          # every section, 8 workers
    python bench/gpu.py --sections transfer --workers 4,8
    python bench/gpu.py --quick --json out.json

Sections:

- ``copy``: the hardware's limit: a pinned host -> GPU copy of a 9.6 MB batch
  (``non_blocking``), repeated.
- ``transfer``: the ``transfer`` workload (a 224x224x3 uint8 image per sample, batch 64 =
  9.6 MB; ``procpipe/bench/workloads.py``) delivered to the GPU: torch's DataLoader with
  ``pin_memory=True`` (the loop copies each batch with ``.to("cuda", non_blocking=True)``)
  against ``procpipe.Loader(device="cuda")`` (batches arrive on the GPU, copied straight from
  the CUDA-registered ring). GB/s, against the ``copy`` limit; the consumer does nothing else.
- ``jpeg``: ResNet-18 training (torchvision, bf16 autocast, channels_last, batch 256) fed by
  a JPEG pipeline over generated 320x320 JPEGs (``examples/jpeg_training.py``): torch's
  DataLoader decoding and augmenting with Pillow in its workers; procpipe doing the same
  (``mode cpu``); procpipe with ``device_fn`` doing the random crops, flips and normalization
  on the GPU (``augment``: the workers decode and resize); procpipe with ``device_fn``
  decoding with nvJPEG too (``decode``: the workers only read the bytes); and the training
  step alone on a batch already on the GPU (the ceiling). Images/s.

For every engine: the share of the measured time the consumer spent waiting in ``next()``
(wait %). For procpipe also: overflow warnings, batches larger than their slot, batches
that came inline through the pipes during the measured window, and batches copied
straight from the registered ring (``direct``) or through a staging buffer (``staged``).
Each run first warms up (start-up, cuDNN autotuning, the ring sized by the first batches)
and then measures a fixed number of batches. Targets are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))  # the JPEG pipeline (workers inherit it)

import jpeg_training as jt  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.utils.data as tud  # noqa: E402

import procpipe  # noqa: E402
from procpipe.bench.workloads import WORKLOADS, TransferDataset  # noqa: E402

TRANSFER_BATCH = WORKLOADS["transfer"].batch_size
CUDA = torch.device("cuda")


# --------------------------------------------------------------------------- helpers
class Watch:
    """Counts what a procpipe run must not do: overflow warnings, overflowing and inline batches
    (from ``stats()``, between ``start()`` and ``stop()``)."""

    def __init__(self, loader: procpipe.Loader) -> None:
        self.loader = loader
        self.caught = warnings.catch_warnings(record=True)

    def __enter__(self) -> Watch:  # noqa: PYI034 -- typing.Self is 3.11+, and procpipe supports 3.10
        self.records = self.caught.__enter__()
        warnings.simplefilter("always")
        return self

    def start(self) -> None:
        s = self.loader.stats()
        self.base = (s["epoch"], s["overflow_batches"], s["bytes_inline"])

    def stop(self) -> dict[str, Any]:
        s = self.loader.stats()
        same_epoch = s["epoch"] == self.base[0]
        return {
            "overflow_batches": s["overflow_batches"] - (self.base[1] if same_epoch else 0),
            "inline_bytes": s["bytes_inline"] - (self.base[2] if same_epoch else 0),
            "device": s["device"],
            "ring_slot_bytes": s["ring_slot_bytes"],
        }

    def __exit__(self, *exc: object) -> None:
        self.caught.__exit__(*exc)
        self.warnings = [str(w.message) for w in self.records if "procpipe" in str(w.message)]


class CpuClock:
    """CPU time of this process's threads (by thread name) and of its child processes (the
    workers) over a window: where the consumer's process spends its time (profiling)."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")

    def read(self) -> tuple[dict[str, float], float]:
        names = {t.native_id: t.name for t in threading.enumerate()}
        threads: dict[str, float] = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            name = names.get(int(tid), "other threads (torch, CUDA)")
            threads[name] = threads.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / self.tick
        children = 0.0
        for child in psutil.Process().children(recursive=True):
            try:
                times = child.cpu_times()
                children += times.user + times.system
            except psutil.Error:
                pass
        return threads, children

    def start(self) -> None:
        self.begun = self.read()

    def stop(self, wall: float) -> dict[str, Any]:
        (threads, children), (threads0, children0) = self.read(), self.begun
        busy = {name: (cpu - threads0.get(name, 0.0)) / wall for name, cpu in threads.items()}
        return {
            "thread_cpu": {k: round(v, 2) for k, v in sorted(busy.items(), key=lambda kv: -kv[1]) if v >= 0.05},
            "children_cpu": round((children - children0) / wall, 2),
        }


def cpu_line(t: dict[str, Any]) -> str:
    threads = ", ".join(f"{name} {100 * v:.0f} %" for name, v in t["thread_cpu"].items())
    return f"    CPU: {threads}; worker processes {100 * t['children_cpu']:.0f} % (of one core)"


def timed(it: Iterator, warmup: int, count: int, each: Any, on_start: Any = None) -> dict[str, Any]:
    """Take ``warmup`` batches, then time ``count`` (``each(batch)`` per batch; the GPU is
    synchronized at both ends): seconds, seconds spent waiting in ``next()``, and the CPU
    time of each thread and of the workers (``CpuClock``)."""
    for _ in range(warmup):
        each(next(it))
    torch.cuda.synchronize()
    if on_start is not None:
        on_start()
    clock = CpuClock()
    clock.start()
    waited = 0.0
    started = time.perf_counter()
    for _ in range(count):
        t = time.perf_counter()
        batch = next(it)
        waited += time.perf_counter() - t
        each(batch)
        del batch
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    return {"wall_s": wall, "wait_fraction": waited / wall, **clock.stop(wall)}


def forever(loader: Any) -> Iterator:
    while True:
        yield from loader


# --------------------------------------------------------------------------- copy
def run_copy(opts: argparse.Namespace) -> dict[str, Any]:
    nbytes = TRANSFER_BATCH * int(np.prod((224, 224, 3)))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device=CUDA)
    for _ in range(10):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    n = 50 if opts.quick else 200
    started = time.perf_counter()
    for _ in range(n):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    gbs = n * nbytes / (time.perf_counter() - started) / 1e9
    print(f"pinned host -> GPU copy of a {nbytes / 1e6:.1f} MB batch: {gbs:.1f} GB/s")
    return {"pinned_copy_gbs": gbs, "batch_bytes": nbytes}


# --------------------------------------------------------------------------- transfer
def run_transfer(opts: argparse.Namespace, limit: float | None) -> list[dict[str, Any]]:
    rows = []
    batch_bytes = TRANSFER_BATCH * 224 * 224 * 3
    for workers in opts.workers:
        warm = 4 * workers + 8
        torch_count = 150 if opts.quick else 400
        pp_count = 600 if opts.quick else 2000
        # torch: pinned batches, copied in the loop like a training loop does
        dataset = TransferDataset(TRANSFER_BATCH * (warm + torch_count))
        loader = tud.DataLoader(
            dataset,
            batch_size=TRANSFER_BATCH,
            num_workers=workers,
            pin_memory=True,
            persistent_workers=True,
            prefetch_factor=4,
            multiprocessing_context="fork",
        )
        t = timed(iter(loader), warm, torch_count, lambda b: b.to(CUDA, non_blocking=True))
        del loader
        torch_gbs = torch_count * batch_bytes / t["wall_s"] / 1e9
        row = {
            "section": "transfer",
            "workers": workers,
            "engine": "torch DataLoader pin_memory",
            "gbs": torch_gbs,
            **t,
        }
        rows.append(row)
        torch_cpu = cpu_line(t)
        # procpipe: batches arrive on the GPU. Twice: with the default per-sample reseeding of
        # the global generators (~15-20 us a sample with torch imported), and without it
        # (seed_globals=False: this workload draws no random numbers).
        for seed_globals in (True, False):
            dataset = TransferDataset(TRANSFER_BATCH * (warm + pp_count))
            with (
                procpipe.Loader(
                    dataset, batch_size=TRANSFER_BATCH, workers=workers, device="cuda", seed_globals=seed_globals
                ) as pp,
                Watch(pp) as watch,
            ):
                t = timed(iter(pp), warm, pp_count, lambda b: None, watch.start)
                extra = watch.stop()
            pp_gbs = pp_count * batch_bytes / t["wall_s"] / 1e9
            engine = "procpipe device=cuda" + ("" if seed_globals else " seed_globals=False")
            rows.append(
                {
                    "section": "transfer",
                    "workers": workers,
                    "engine": engine,
                    "gbs": pp_gbs,
                    **t,
                    "overflow_warnings": len(watch.warnings),
                    **extra,
                }
            )
            print(
                f"transfer, {workers} workers: torch DataLoader pin_memory {torch_gbs:.1f} GB/s "
                f"(wait {100 * row['wait_fraction']:.0f} %) | {engine} {pp_gbs:.1f} GB/s "
                f"(wait {100 * t['wait_fraction']:.0f} %), {pp_gbs / torch_gbs:.1f}x torch"
                + (f", {100 * pp_gbs / limit:.0f} % of the pinned-copy limit" if limit else "")
                + f" | overflow warnings {len(watch.warnings)}, overflow batches {extra['overflow_batches']}, "
                f"inline bytes {extra['inline_bytes']}, device {extra['device']}"
            )
            print(f"  torch {torch_cpu.strip()}\n  procpipe {cpu_line(t).strip()}")
    return rows


# --------------------------------------------------------------------------- jpeg
class TorchJpegs(tud.Dataset):
    """torch's side of ``--mode cpu``: the same decode + augment, numpy's generator per worker."""

    def __init__(self, files: jt.JpegFiles, size: int) -> None:
        self.files = files
        self.fn = jt.DecodeAugment(size)
        self.rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.rng is None:
            self.rng = np.random.default_rng(torch.initial_seed() % (1 << 63))
        image, label = self.fn(self.files[i], self.rng)
        return torch.from_numpy(image), int(label)


def run_jpeg(opts: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    steps = 12 if opts.quick else 40
    warm = 4 if opts.quick else 8
    batch, size = 256, 224
    with tempfile.TemporaryDirectory() as directory:
        made = time.perf_counter()
        files = jt.JpegFiles(jt.make_jpegs(directory, opts.images, size=320))
        print(
            f"generated {opts.images} JPEGs of 320x320 ({files.max_bytes} bytes at most) in "
            f"{time.perf_counter() - made:.1f} s"
        )
        trainer = jt.Trainer(CUDA)
        # the ceiling: training on a batch already on the GPU
        x = jt.normalize(torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, device=CUDA))
        y = torch.randint(0, jt.CLASSES, (batch,), device=CUDA)
        t = timed(iter(lambda: (x, y), None), warm, steps, lambda b: trainer.step(*b))
        gpu_only = steps * batch / t["wall_s"]
        rows.append({"section": "jpeg", "engine": "GPU only (data already on the GPU)", "images_per_s": gpu_only})
        print(f"ResNet-18 bf16 channels_last, batch {batch}, data already on the GPU: {gpu_only:.0f} img/s")
        for workers in opts.jpeg_workers:
            torch_loader = tud.DataLoader(
                TorchJpegs(files, size),
                batch_size=batch,
                shuffle=True,
                num_workers=workers,
                pin_memory=True,
                persistent_workers=True,
                prefetch_factor=4,
                multiprocessing_context="fork",
                drop_last=True,
            )

            def torch_step(b: Any) -> None:
                images, labels = b
                images = jt.normalize(images.to(CUDA, non_blocking=True).permute(0, 3, 1, 2))
                trainer.step(images, labels.to(CUDA, non_blocking=True))

            t = timed(forever(torch_loader), warm, steps, torch_step)
            del torch_loader
            torch_rate = steps * batch / t["wall_s"]
            rows.append(
                {
                    "section": "jpeg",
                    "workers": workers,
                    "engine": "torch DataLoader pin_memory (Pillow)",
                    "images_per_s": torch_rate,
                    **t,
                }
            )
            print(
                f"jpeg, {workers} workers: torch DataLoader pin_memory, Pillow decode+augment: "
                f"{torch_rate:.0f} img/s (wait {100 * t['wait_fraction']:.0f} %)\n{cpu_line(t)}"
            )
            for mode in opts.modes:
                with jt.make_loader(mode, files, size, batch, workers, "cuda", source_size=256) as pp:
                    it = jt.batches(mode, iter(pp))
                    with Watch(pp) as watch:
                        t = timed(it, warm, steps, lambda b: trainer.step(*b), watch.start)
                        extra = watch.stop()
                rate = steps * batch / t["wall_s"]
                name = {
                    "cpu": "procpipe (Pillow decode+augment in workers)",
                    "augment": "procpipe device_fn augment (workers decode+resize)",
                    "decode": "procpipe device_fn nvJPEG decode+augment (workers read bytes)",
                }[mode]
                rows.append(
                    {
                        "section": "jpeg",
                        "workers": workers,
                        "engine": name,
                        "mode": mode,
                        "images_per_s": rate,
                        **t,
                        "overflow_warnings": len(watch.warnings),
                        **extra,
                    }
                )
                print(
                    f"jpeg, {workers} workers: {name}: {rate:.0f} img/s (wait {100 * t['wait_fraction']:.0f} %), "
                    f"{rate / torch_rate:.2f}x torch, {100 * rate / gpu_only:.0f} % of GPU-only | overflow "
                    f"warnings {len(watch.warnings)}, overflow batches {extra['overflow_batches']}, inline bytes "
                    f"{extra['inline_bytes']}, device {extra['device']}\n{cpu_line(t)}"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="copy,transfer,jpeg")
    parser.add_argument("--workers", default="8", help="worker counts for the transfer section, e.g. 4,8")
    parser.add_argument("--jpeg-workers", default="8", help="worker counts for the jpeg section")
    parser.add_argument("--modes", default="cpu,augment,decode", help="procpipe's JPEG pipelines")
    parser.add_argument("--images", type=int, default=3000, help="JPEGs generated for the jpeg section")
    parser.add_argument("--quick", action="store_true", help="fewer batches (a smoke test)")
    parser.add_argument("--json", default=None, help="write every row to this file")
    opts = parser.parse_args()
    opts.workers = [int(w) for w in opts.workers.split(",")]
    opts.jpeg_workers = [int(w) for w in opts.jpeg_workers.split(",")]
    opts.modes = [m for m in opts.modes.split(",") if m]
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device (torch.cuda.is_available() is False)")
    sections = set(opts.sections.split(","))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "rows": [],
    }
    limit = None
    if "copy" in sections:
        out["copy"] = run_copy(opts)
        limit = out["copy"]["pinned_copy_gbs"]
    if "transfer" in sections:
        out["rows"] += run_transfer(opts, limit)
    if "jpeg" in sections:
        out["rows"] += run_jpeg(opts)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
