"""Several epochs in one stream, and workers="auto".

One ``iter(loader)`` spans 3 epochs (``epochs=3``): the workers go on across epoch
boundaries, and ``with_epoch=True`` tells which epoch each batch belongs to. The worker
count is chosen while the loader runs (``workers="auto"``); ``stats()["autotune"]``
shows the trace of its decisions.
"""
import collections
import time

import numpy as np

import procpipe


def features(index: int) -> dict:
    """About 1 ms of pure Python per sample (holding the GIL), plus a random flip."""
    total = 0
    for k in range(6000):
        total += (index * k) % 7
    vector = np.full(16, total % 251, dtype=np.float32)
    if procpipe.sample_rng().random() < 0.5:
        vector = -vector
    return {"x": vector, "index": index}


if __name__ == "__main__":
    seen = collections.defaultdict(list)
    started = time.perf_counter()
    with procpipe.Loader(range(1200), features, batch_size=20, shuffle=True, seed=1,
                         epochs=3, with_epoch=True, workers="auto") as loader:
        for epoch, batch in loader:
            seen[epoch].extend(batch["index"].tolist())
        stats = loader.stats()
    elapsed = time.perf_counter() - started
    for epoch, indices in sorted(seen.items()):
        print(f"epoch {epoch}: {len(indices)} samples, every index once: {sorted(indices) == list(range(1200))}, "
              f"first indices {indices[:4]}")
    print(f"orders differ between epochs: {seen[0] != seen[1] != seen[2]}")
    tune = stats["autotune"]
    print(f"{sum(map(len, seen.values()))} samples in {elapsed:.1f} s; autotune limit {tune['limit']} workers, "
          f"now {stats['workers']}")
    for time_s, workers, batches_per_s, wait in tune["trace"][:8]:
        print(f"  t={time_s:5.2f}s  workers={workers}  {batches_per_s:6.1f} batches/s  consumer waited {100 * wait:3.0f} %")
