"""ImageNet-style training fed by procpipe: JPEG decoding and augmentation, on the CPU workers
or on the GPU through ``device_fn``.

Three ways to split the work between the worker processes and the device:

- ``--mode cpu``: the workers decode each JPEG with Pillow, random-resized-crop and flip it
  (``procpipe.sample_rng()``); uint8 batches go to the device, where the loop normalizes.
  Throughput is bounded by the CPUs.
- ``--mode augment``: the workers decode and resize to a fixed size (deterministic work);
  ``device_fn`` does the random crops, flips and normalization on the device, in
  procpipe's device stage (its thread, its CUDA stream), with ``procpipe.batch_rng()``.
- ``--mode decode`` (needs torchvision): the workers only read the file bytes (padded into
  a fixed-size uint8 array, so the batch travels through the shared-memory ring);
  ``device_fn`` decodes them with ``torchvision.io.decode_jpeg(device=...)`` (nvJPEG on a
  GPU), then crops, flips and normalizes. The CPUs do almost nothing.

What belongs where: per-sample Python and anything that must not depend on the batch
(reading, parsing, deterministic decoding) in ``fn``, in the workers; vectorizable
per-batch tensor work (decoding on the GPU, crops/flips, dtype conversion, normalization)
in ``device_fn``, where one kernel serves the whole batch and overlaps training.

Run (the JPEGs are generated at start; nothing is downloaded):

    python examples/jpeg_training.py                      # CPU, small: a few steps of a tiny CNN
    python examples/jpeg_training.py --device cuda --mode decode --images 3000 --batch 256 \
        --size 224 --steps 40 --workers 8                 # a GPU: ResNet-18, bf16, channels_last

``bench/gpu.py`` times these pipelines against torch's DataLoader.
"""
from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

import procpipe

MEAN = torch.tensor([0.485, 0.456, 0.406]) * 255
STD = torch.tensor([0.229, 0.224, 0.225]) * 255
CLASSES = 1000


# --------------------------------------------------------------------------- the data
def make_jpegs(directory: str, count: int, size: int = 320, unique: int = 256, seed: int = 0) -> list[str]:
    """Write ``count`` JPEG files of ``size`` x ``size`` (``unique`` distinct pictures: smooth
    colour fields with noise, so they compress like photographs) and return their paths."""
    def picture(k: int) -> bytes:
        rng = np.random.default_rng((seed, k))
        coarse = rng.integers(0, 256, (max(2, size // 32), max(2, size // 32), 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize((size, size), Image.BICUBIC), np.int16)
        noisy = np.clip(smooth + rng.integers(-12, 13, smooth.shape), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(noisy).save(out, "JPEG", quality=90)
        return out.getvalue()

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # Pillow encodes without the GIL
        blobs = list(pool.map(picture, range(min(unique, count))))
    paths = []
    for i in range(count):
        path = os.path.join(directory, f"{i:06d}.jpg")
        with open(path, "wb") as f:
            f.write(blobs[i % len(blobs)])
        paths.append(path)
    return paths


class JpegFiles:
    """A map-style dataset of JPEG files: ``(file bytes, label)``."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.max_bytes = max(os.path.getsize(p) for p in paths)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        with open(self.paths[i], "rb") as f:
            return f.read(), i % CLASSES


def crop_boxes(rng: np.random.Generator, n: int, height: int, width: int,
               scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> np.ndarray:
    """``n`` RandomResizedCrop boxes ``(x0, y0, w, h)`` for a ``height`` x ``width`` image, as
    torchvision draws them (10 tries, then the whole image), vectorized."""
    area = height * width
    boxes = np.tile(np.array([0.0, 0.0, width, height]), (n, 1))
    todo = np.ones(n, bool)
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1], n)
        aspect = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1]), n))
        w = np.round(np.sqrt(target * aspect))
        h = np.round(np.sqrt(target / aspect))
        ok = todo & (w > 0) & (h > 0) & (w <= width) & (h <= height)
        x0 = np.floor(rng.random(n) * (width - w + 1))
        y0 = np.floor(rng.random(n) * (height - h + 1))
        boxes[ok] = np.stack([x0, y0, w, h], 1)[ok]
        todo &= ~ok
        if not todo.any():
            break
    return boxes


# ---- worker side (fn) ---------------------------------------------------------------------
class DecodeAugment:
    """``--mode cpu`` fn: decode, random-resized-crop to ``size`` and flip, with ``sample_rng()``
    (or ``rng``, for torch's DataLoader)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, item: tuple[bytes, int], rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.int64]:
        data, label = item
        rng = rng if rng is not None else procpipe.sample_rng()
        image = Image.open(io.BytesIO(data)).convert("RGB")
        x0, y0, w, h = crop_boxes(rng, 1, image.height, image.width)[0]
        image = image.resize((self.size, self.size), Image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))
        if rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return np.array(image), np.int64(label)


class DecodeResize:
    """``--mode augment`` fn: decode and resize to a fixed ``size`` (no randomness)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, item: tuple[bytes, int]) -> tuple[np.ndarray, np.int64]:
        data, label = item
        image = Image.open(io.BytesIO(data))
        image.draft("RGB", (self.size, self.size))  # let libjpeg decode at a reduced scale when it can
        image = image.convert("RGB").resize((self.size, self.size), Image.BILINEAR)
        return np.asarray(image), np.int64(label)


class ReadBytes:
    """``--mode decode`` fn: the file's bytes, padded to ``max_bytes`` so the batch is one array."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    def __call__(self, item: tuple[bytes, int]) -> dict[str, Any]:
        data, label = item
        padded = np.zeros(self.max_bytes, np.uint8)
        padded[:len(data)] = np.frombuffer(data, np.uint8)
        return {"jpeg": padded, "length": np.int64(len(data)), "label": np.int64(label)}


# ---- device side (device_fn) --------------------------------------------------------------
def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8/float NCHW images -> normalized float32, channels_last."""
    mean, std = MEAN.to(images.device)[None, :, None, None], STD.to(images.device)[None, :, None, None]
    return ((images.float() - mean) / std).contiguous(memory_format=torch.channels_last)


def random_resized_crop(images: torch.Tensor, rng: np.random.Generator, size: int) -> torch.Tensor:
    """A random-resized crop and a random horizontal flip of every image of an NCHW float batch,
    in one batched ``grid_sample`` (bilinear)."""
    n, _, height, width = images.shape
    boxes = crop_boxes(rng, n, height, width)
    flip = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    theta = np.zeros((n, 2, 3), np.float32)
    theta[:, 0, 0] = boxes[:, 2] / width * flip
    theta[:, 0, 2] = (boxes[:, 0] + boxes[:, 2] / 2) / width * 2 - 1
    theta[:, 1, 1] = boxes[:, 3] / height
    theta[:, 1, 2] = (boxes[:, 1] + boxes[:, 3] / 2) / height * 2 - 1
    grid = F.affine_grid(torch.from_numpy(theta).to(images.device), [n, 3, size, size], align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


class AugmentOnDevice:
    """``--mode augment`` device_fn: crops, flips (``batch_rng()``) and normalization on the device."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = batch
        x = images.permute(0, 3, 1, 2).float()  # NHWC uint8 -> NCHW (channels_last) float
        return normalize(random_resized_crop(x, procpipe.batch_rng(), self.size)), labels


class DecodeOnDevice:
    """``--mode decode`` device_fn: JPEG decoding with ``torchvision.io.decode_jpeg`` on the batch's
    device (nvJPEG on a GPU), then crops, flips and normalization.

    decode_jpeg reads its input from host memory: the padded bytes come back from the device
    (a small copy) before the images are decoded there.
    """

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        from torchvision.io import decode_jpeg

        labels = batch["label"]
        data = batch["jpeg"].cpu()
        lengths = batch["length"].tolist()
        images = decode_jpeg([data[i, :n] for i, n in enumerate(lengths)], device=labels.device)
        if len({tuple(im.shape) for im in images}) > 1:  # pictures of different sizes: one common size first
            images = [F.interpolate(im[None].float(), size=tuple(images[0].shape[1:]), mode="bilinear")[0]
                      for im in images]
        x = torch.stack(images).float()
        return normalize(random_resized_crop(x, procpipe.batch_rng(), self.size)), labels


# --------------------------------------------------------------------------- the model
class TinyNet(nn.Module):
    """Where torchvision is absent (the CPU demo): a small CNN."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_model(device: torch.device) -> nn.Module:
    try:
        import torchvision

        model: nn.Module = torchvision.models.resnet18(num_classes=CLASSES)
    except ImportError:
        model = TinyNet()
    return model.to(device).to(memory_format=torch.channels_last)


class Trainer:
    """One SGD step per batch; bf16 autocast on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.model = make_model(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = F.cross_entropy(self.model(images), labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- the pipelines
def make_loader(mode: str, files: JpegFiles, size: int, batch: int, workers: int, device: str,
                source_size: int, seed: int = 0) -> procpipe.Loader:
    """The procpipe loader of a mode: yields ``(images, labels)`` on ``device``; ``epochs=None``."""
    common = dict(batch_size=batch, workers=workers, shuffle=True, seed=seed, device=device, epochs=None)
    if mode == "cpu":
        return procpipe.Loader(files, DecodeAugment(size), **common)
    if mode == "augment":
        return procpipe.Loader(files, DecodeResize(source_size), device_fn=AugmentOnDevice(size), **common)
    if mode == "decode":
        return procpipe.Loader(files, ReadBytes(files.max_bytes), device_fn=DecodeOnDevice(size), **common)
    raise ValueError(f"unknown mode {mode!r}")


def batches(mode: str, loader: Iterator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Model-ready ``(images, labels)``: ``--mode cpu`` batches are normalized here, in the loop."""
    for images, labels in loader:
        if mode == "cpu":
            images = normalize(images.permute(0, 3, 1, 2))
        yield images, labels


def train(mode: str, loader: procpipe.Loader, trainer: Trainer, steps: int, warmup: int) -> dict[str, float]:
    """``warmup`` steps, then ``steps`` timed ones: images/s and the share of time waiting for data."""
    it = batches(mode, loader)
    for _ in range(warmup):
        trainer.step(*next(it))
    synchronize(trainer.device)
    waited, images = 0.0, 0
    started = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        x, y = next(it)
        waited += time.perf_counter() - t
        trainer.step(x, y)
        images += len(y)
    synchronize(trainer.device)
    wall = time.perf_counter() - started
    return {"images_per_s": images / wall, "wait_fraction": waited / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", choices=["cpu", "augment", "decode"], default=None,
                        help="default: decode where torchvision is installed, else augment")
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--picture", type=int, default=96, help="side of the generated JPEGs")
    parser.add_argument("--size", type=int, default=64, help="side of the crops the model sees")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    mode = args.mode
    if mode is None:
        try:
            import torchvision  # noqa: F401

            mode = "decode"
        except ImportError:
            mode = "augment"
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as directory:
        files = JpegFiles(make_jpegs(directory, args.images, size=args.picture))
        trainer = Trainer(device)
        with make_loader(mode, files, args.size, args.batch, args.workers, args.device, args.picture) as loader:
            result = train(mode, loader, trainer, args.steps, warmup=1)
            stats = loader.stats()
    print(f"mode={mode} device={device} model={type(trainer.model).__name__} workers={args.workers} "
          f"batch={args.batch}: {result['images_per_s']:.0f} images/s, waiting for data "
          f"{100 * result['wait_fraction']:.0f} % of the time")
    print(f"overflow batches: {stats['overflow_batches']}, device: {stats['device']}")


if __name__ == "__main__":
    main()
