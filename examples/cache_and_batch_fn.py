"""Cache an expensive deterministic decode, augment on top every epoch, normalize per batch.

- ``fn=decode`` is deterministic and slow (about 1 ms per sample here): with ``cache=True``
  its output is computed once per index and kept in shared memory; later epochs skip it.
- ``augment`` is random and cheap: it runs every epoch on a copy of the cached sample, with
  ``procpipe.sample_rng()`` (seeded from (seed, epoch, index)).
- ``batch_fn=normalize`` is vectorized: it runs once per collated batch, in the worker.

The batches are identical to an uncached run with ``workers=0``.
"""
import time

import numpy as np

import procpipe

records = [{"id": f"img-{i:04d}", "label": i % 10} for i in range(1000)]


def decode(record):
    """Deterministic and slow, like decoding a JPEG: cached."""
    seed = int(record["id"][4:])
    acc = seed + 1
    for _ in range(8000):  # about 1 ms of pure Python
        acc = (acc * 1103515245 + 12345) & 0x7FFFFFFF
    image = np.random.default_rng(acc).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    return {"image": image, "label": record["label"]}


def augment(sample):
    """Random and cheap: every epoch, on a private copy of the cached sample."""
    rng = procpipe.sample_rng()
    if rng.random() < 0.5:
        sample["image"] = sample["image"][:, ::-1]
    return sample


def normalize(batch):
    """Vectorized over the whole batch, once per batch, in the worker."""
    images = batch["image"].astype(np.float32) / 255.0
    images = (images - images.mean(axis=(1, 2, 3), keepdims=True)) / (images.std(axis=(1, 2, 3), keepdims=True) + 1e-6)
    images *= procpipe.batch_rng().uniform(0.9, 1.1)  # one random contrast per batch
    return {"image": images, "label": batch["label"]}


def first_epoch(loader):
    return [np.array(batch["image"]) for batch in loader]


if __name__ == "__main__":
    options = dict(batch_size=64, shuffle=True, seed=0, augment=augment, batch_fn=normalize)
    with procpipe.Loader(records, decode, workers=2, cache=True, **options) as loader:
        info = loader.cache_info()
        where = info["directory"] or "shared memory"
        print(f"cache: {info['samples']} samples x {info['sample_bytes']} bytes in {where}, "
              f"{info['filled']} filled at creation")
        for epoch in range(3):
            started = time.perf_counter()
            samples = 0
            for batch in loader:
                samples += len(batch["label"])
            print(f"epoch {epoch}: {samples} samples in {time.perf_counter() - started:.2f} s, "
                  f"batch image {batch['image'].dtype} {batch['image'].shape}")
        print(f"cache filled: {loader.cache_info()['filled']}/{info['samples']}")
        loader.set_epoch(0)
        cached = first_epoch(loader)
    with procpipe.Loader(records, decode, workers=0, **options) as plain:
        uncached = first_epoch(plain)
    same = len(cached) == len(uncached) and all(np.array_equal(a, b) for a, b in zip(cached, uncached))
    print(f"identical to an uncached run with workers=0: {'yes' if same else 'no'}")
